"""Doctor's check that the checkpoint fits the model config.json describes: every tensor's name and shape
through the loader's own name mapping and weight loaders, on the meta device (no tensor is read)."""

from __future__ import annotations

from pagoda.config import derived_max_model_len
from pagoda.errors import PagodaError
from pagoda.tools.doctor.check import Check, State


def check_weights_match_model(state: State) -> Check:
    """Build the model on the meta device and feed it the headers' names and shapes through the real
    name mapping and weight loaders: config/weights mismatches show up without reading a tensor."""
    import torch  # lazy: torch (`pagoda` starts without it)

    from pagoda.models.loader import WeightRouter  # lazy: torch (`pagoda` starts without it)
    from pagoda.models.registry import get_model_class  # lazy: torch (`pagoda` starts without it)

    cfg = state.hf_config
    try:
        model_class = get_model_class((cfg.get("architectures") or ["<missing>"])[0])
        with torch.device("meta"):
            model = model_class(cfg, derived_max_model_len(cfg))
        model.tie_weights()
    except PagodaError as exc:
        return Check(
            "checkpoint vs model",
            "FAIL",
            f"the model cannot be built from config.json: {exc.message}",
            "fix config.json",
        )
    except (KeyError, TypeError, ValueError) as exc:
        return Check(
            "checkpoint vs model",
            "FAIL",
            f"the model cannot be built from config.json ({type(exc).__name__}: {exc})",
            "fix config.json or re-download it",
        )
    router = WeightRouter(model)
    params = router.params
    problems: list[str] = []
    count = 0
    for header in state.headers.values():
        for raw_name, info in header.items():
            if raw_name == "__metadata__":
                continue
            try:
                target = router.target(raw_name)
            except KeyError:
                problems.append(f"checkpoint tensor {raw_name!r} has no parameter in {model_class.__name__}")
                continue
            if target is None:
                continue
            try:
                empty = torch.empty([int(d) for d in info["shape"]], dtype=target.param.dtype, device="meta")
                target.loader(target.param, empty, target.shard)
            except ValueError as exc:
                problems.append(f"{raw_name!r}: {exc}")
            except (NotImplementedError, RuntimeError):
                pass  # this loader cannot run on meta tensors: loading will check the shape
            router.loaded.add(target.key)
            count += 1
    if not problems:
        try:
            router.check_complete()
        except PagodaError as exc:
            problems.append(exc.message)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Check(
            "checkpoint vs model",
            "FAIL",
            problems[0] + more,
            "config.json does not match these weights: re-download the model, or fix its config.json",
        )
    return Check(
        "checkpoint vs model",
        "ok",
        f"{count} checkpoint tensors map onto all {len(params)} parameters of {model_class.__name__}, shapes match",
        None,
    )
