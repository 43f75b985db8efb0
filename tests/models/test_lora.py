"""LoRA adapters (`pagoda/lora/`) against PEFT: adapters made with `peft` on a tiny random Llama (and Qwen2), each
compared with PEFT's merged model (transformers, fp32): the greedy tokens and each token's logprob (1e-4), with
three adapters and the base model in one batch, fewer adapter slots than adapters (the scheduler holds requests
back), a host cache smaller than the adapters (read again after eviction), and prefix caching that must not
share KV between adapters. Every malformed adapter is refused by its message, and the engine carries on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft  # a test dependency (pyproject's `test` extra): missing, these tests fail rather than skip
import pytest
import safetensors.torch
import torch

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError, InvalidRequest
from pagoda.lora.request import LoRARequest
from tests.conftest import FIXTURES, build_tiny_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (rank, alpha, targets, rsLoRA)
    "attn": (8, 16, ATTENTION, False),
    "mlp": (4, 8, MLP, True),
    "all": (16, 8, ATTENTION + MLP, False),
}
PROMPTS = [[5, 17, 99, 230, 7, 41], [300, 2, 64, 128, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
MAX_TOKENS = 6


def _hf(folder: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def _make_adapter(
    base: str, out: Path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int, safe: bool = True
) -> str:
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(_hf(base), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: an adapter that changes nothing would prove nothing
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    model.save_pretrained(str(out), safe_serialization=safe)
    return str(out)


def _reference(base: str, adapter: str | None, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    """PEFT's merged model: greedy tokens and each one's logprob, per prompt."""
    model = _hf(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return _greedy(model, prompts)


def _greedy(model, prompts) -> list[tuple[list[int], list[float]]]:
    model.generation_config.eos_token_id = None  # the engine side ignores EOS: run to MAX_TOKENS here too
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens = gen.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.scores, tokens)]
        out.append((tokens, logprobs))
    return out


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model("llama", str(root / "base"))
    adapters = {
        name: _make_adapter(base, root / name, rank, alpha, targets, rslora, seed)
        for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items())
    }
    refs = {name: _reference(base, path) for name, path in adapters.items()} | {None: _reference(base, None)}
    return base, adapters, refs


def _requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


def _llm(base: str, **kw) -> LLM:
    # A fixed KV pool: on a GPU an engine sized from free memory would count the earlier tests' engines as used.
    kw = {"max_lora_rank": 16, "num_gpu_blocks_override": 256, **kw}
    return LLM(base, skip_tokenizer_init=True, dtype="float32", enable_lora=True, **kw)


def _check(outputs, expected) -> None:
    for out, (tokens, logprobs) in zip(outputs, expected, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        got = [step[t].logprob for step, t in zip(completion.logprobs, tokens)]
        assert got == pytest.approx(logprobs, abs=1e-4)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def test_three_adapters_and_the_base_in_one_batch_equal_peft_merged(lora_setup):
    base, adapters, refs = lora_setup
    requests = _requests(adapters)
    llm = _llm(base, max_loras=3)
    names = [*ADAPTERS, None]
    prompts = [p for _ in names for p in PROMPTS]
    loras = [requests[n] if n else None for n in names for _ in PROMPTS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False, lora_request=loras)
    for i, name in enumerate(names):
        _check(outputs[i * len(PROMPTS) : (i + 1) * len(PROMPTS)], refs[name])


def test_fewer_slots_and_host_copies_than_adapters(lora_setup, monkeypatch):
    """max_loras=1: requests of a second adapter wait until the first adapter's finish (no step has two);
    max_cpu_loras=1: an adapter evicted from the host is read again when asked for."""
    import pagoda.lora.manager as manager

    base, adapters, refs = lora_setup
    requests = _requests(adapters)
    reads = []
    real = manager.load_peft_adapter
    monkeypatch.setattr(manager, "load_peft_adapter", lambda r, *a: reads.append(r.lora_name) or real(r, *a))
    llm = _llm(base, max_loras=1, max_cpu_loras=1)
    per_step = []
    prepare = llm.engine.runner.lora.prepare
    llm.engine.runner.lora.prepare = lambda rows, lens: (
        per_step.append({r.lora_int_id for r in rows if r}) or prepare(rows, lens)
    )
    for _ in range(2):
        for name in ("attn", "mlp"):
            outputs = llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False, lora_request=requests[name]
            )
            _check(outputs, refs[name])
    both = [*ADAPTERS]
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}] * 3, _params(), use_tqdm=False, lora_request=[requests[n] for n in both]
    )
    for out, name in zip(outputs, both):
        _check([out], refs[name][:1])
    assert max(len(s) for s in per_step) == 1
    assert reads.count("attn") >= 2 and reads.count("mlp") >= 2  # evicted by the other, read again


def test_adapters_added_ahead_are_on_the_device_before_their_first_step(lora_setup, monkeypatch):
    """Adapters read before any request (the server's --lora-modules) fill the free device slots at once; one
    beyond the slots is copied to the device when its first step comes. Outputs equal PEFT's either way."""
    from pagoda.lora.layers import LoRASlots

    base, adapters, refs = lora_setup
    requests = _requests(adapters)
    llm = _llm(base, max_loras=2)
    for request in requests.values():
        llm.llm_engine.add_lora(request)
    copies = []
    real = LoRASlots.set
    monkeypatch.setattr(LoRASlots, "set", lambda self, slot, w: copies.append(slot) or real(self, slot, w))
    for name in ("attn", "mlp"):
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False, lora_request=requests[name]
        )
        _check(outputs, refs[name])
    assert copies == []
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False, lora_request=requests["all"]
    )
    _check(outputs, refs["all"])
    assert copies  # the third adapter had no slot until its step


def test_speculative_proposals_are_verified_with_each_rows_adapter(lora_setup):
    """Speculative decoding with adapters: a verify step's rows carry proposals beyond the sampled token, each run
    through its request's adapter. The proposer knows PEFT's answer and proposes its next two tokens and then a
    wrong one, so every verification keeps proposals (whose logits and KV must be the adapter's) and rejects one;
    the greedy tokens and logprobs stay PEFT's merged models' (and the base model's, in the same steps)."""
    base, adapters, refs = lora_setup
    rows = {"attn": 0, "all": 1, None: 2}  # adapter -> its prompt in PROMPTS
    answers = [(PROMPTS[j], refs[name][j][0]) for name, j in rows.items()]

    def propose(array, window: int) -> list[int]:
        tokens = array.tolist()
        prompt, answer = next((p, a) for p, a in answers if tokens[: len(p)] == p)
        rest = answer[len(tokens) - len(prompt) :]
        return rest[:2] + [rest[2] + 1] if len(rest) > 2 else rest[:1]

    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    llm = _llm(base, max_loras=2, speculative_config=spec)
    speculator = llm.engine.speculator
    speculator.ngram.propose = propose
    requests = _requests(adapters)
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPTS[j]} for j in rows.values()],
        _params(),
        use_tqdm=False,
        lora_request=[requests.get(name) for name in rows],
    )
    _check(outputs, [refs[name][j] for name, j in rows.items()])
    counts = speculator.counts
    assert counts.num_accepted_tokens >= counts.num_drafts > 0  # kept proposals ...
    assert counts.num_accepted_tokens < counts.num_draft_tokens  # ... and rejected ones


def test_two_adapters_under_one_id_in_flight_are_refused(lora_setup):
    """Requests of two adapters under one id would share whichever was read last: the second is refused by name
    while the first has requests, and nothing of the call is left queued; once they finish, the id may be reused."""
    base, adapters, refs = lora_setup
    llm = _llm(base, max_loras=2)
    first, second = LoRARequest("attn", 1, adapters["attn"]), LoRARequest("mlp", 1, adapters["mlp"])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    with pytest.raises(InvalidRequest, match=r"LoRA id 1 is adapter 'attn' .* adapter 'mlp' .* needs an id of its own"):
        llm.generate(prompts, _params(), use_tqdm=False, lora_request=[first, second])
    assert not llm.engine.has_unfinished_requests()
    _check(llm.generate(prompts[1:], _params(), use_tqdm=False, lora_request=second), refs["mlp"][1:2])


def test_lora_target_modules_give_slots_to_the_layers_named_only(lora_setup):
    """--lora-target-modules q_proj o_proj: the fused qkv_proj (q_proj's layer) and o_proj take slots, the MLP none;
    an adapter on q/k/v/o runs as PEFT's merged model, one on the MLP is refused naming the flag, and a name that
    is no layer of the model stops the start in one line."""
    base, adapters, refs = lora_setup
    llm = _llm(base, max_loras=2, lora_target_modules=["q_proj", "o_proj"])
    held = {name.rpartition(".")[2] for name in llm.engine.runner.lora.layers}
    assert held == {"qkv_proj", "o_proj"}
    requests = _requests(adapters)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    _check(llm.generate(prompts, _params(), use_tqdm=False, lora_request=requests["attn"]), refs["attn"])
    with pytest.raises(InvalidRequest, match=r"down_proj, a layer --lora-target-modules leaves without adapter slots"):
        llm.generate(prompts[:1], _params(), use_tqdm=False, lora_request=requests["mlp"])
    with pytest.raises(ConfigError, match=r"--lora-target-modules w1: no linear layer of this model is called that"):
        _llm(base, lora_target_modules=["q_proj", "w1"])


def test_prefix_cache_is_not_shared_between_adapters(lora_setup):
    base, adapters, _ = lora_setup
    requests = _requests(adapters)
    llm = _llm(base, max_loras=2)
    long = [[(7 * i + j) % 500 + 3 for j in range(40)] for i in range(2)]  # two full 16-token blocks each
    refs = {name: _reference(base, adapters.get(name), long) for name in ("all", "attn", None)}
    params = [{"prompt_token_ids": p} for p in long]
    _check(llm.generate(params, _params(), use_tqdm=False, lora_request=requests["all"]), refs["all"])
    hits = llm.engine.block_manager.prefix_hits
    _check(llm.generate(params, _params(), use_tqdm=False), refs[None])  # the same prompts, no adapter
    _check(llm.generate(params, _params(), use_tqdm=False, lora_request=requests["attn"]), refs["attn"])
    assert llm.engine.block_manager.prefix_hits == hits  # no block computed under one adapter reused by another
    _check(llm.generate(params, _params(), use_tqdm=False, lora_request=requests["all"]), refs["all"])
    assert llm.engine.block_manager.prefix_hits > hits  # the same adapter again: its own blocks


def _expect_refused(llm: LLM, cases: dict[str, str], first_id: int) -> None:
    """Each adapter path of `cases` is refused with its message (a regex) when a prompt names it."""
    for i, (path, message) in enumerate(cases.items()):
        with pytest.raises(InvalidRequest, match=message):
            llm.generate(
                [{"prompt_token_ids": PROMPTS[0]}],
                _params(),
                use_tqdm=False,
                lora_request=LoRARequest(f"bad{i}", first_id + i, path),
            )


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_bad_adapters_are_refused_by_name_and_the_engine_carries_on(lora_setup, tmp_path):
    base, adapters, refs = lora_setup
    llm = _llm(base, max_lora_rank=8)
    good = Path(adapters["attn"])

    def copy(name: str, **changes) -> str:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        if changes:
            _edit_config(folder, **changes)
        return str(folder)

    missing_weights = copy("no_weights")
    (Path(missing_weights) / "adapter_model.safetensors").unlink()
    no_config = copy("no_config")
    (Path(no_config) / "adapter_config.json").unlink()
    other = build_tiny_model("llama", str(tmp_path / "wider_base"), hidden_size=96)
    wider = _make_adapter(other, tmp_path / "wider", 4, 8, ["q_proj"], False, 7)
    head = _make_adapter(base, tmp_path / "head", 4, 8, ["lm_head"], False, 8)
    tensors = safetensors.torch.load_file(f"{head}/adapter_model.safetensors")  # (PEFT adds the tied head itself)
    safetensors.torch.save_file({k: v for k, v in tensors.items() if "lora_" in k}, f"{head}/adapter_model.safetensors")
    cases = {
        str(tmp_path / "nowhere"): "no such folder",
        no_config: "no adapter_config.json",
        missing_weights: r"no adapter_model.safetensors \(or adapter_model.bin\) there",
        adapters["all"]: "rank 16 is above --max-lora-rank 8",
        copy("dora", use_dora=True): "DoRA",
        copy("bias", bias="all"): "trained biases",
        copy("saved", modules_to_save=["lm_head"]): "modules_to_save",
        wider: "an adapter of another base model",
        head: "lm_head, which is not an adaptable linear layer",
    }
    _expect_refused(llm, cases, first_id=100)
    with pytest.raises(InvalidRequest, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, adapters["attn"])
    ok = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        _params(),
        use_tqdm=False,
        lora_request=LoRARequest("attn", 1, adapters["attn"]),
    )
    _check(ok, refs["attn"])
    assert llm.llm_engine.list_loras() == {1} and llm.llm_engine.remove_lora(1) and not llm.llm_engine.list_loras()
    plain = LLM(base, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=256)
    with pytest.raises(InvalidRequest, match="start with enable_lora=True"):
        plain.generate(
            [{"prompt_token_ids": PROMPTS[0]}],
            _params(),
            use_tqdm=False,
            lora_request=LoRARequest("attn", 1, adapters["attn"]),
        )


def test_pickled_and_hub_id_adapters_equal_peft_merged(lora_setup, tmp_path, monkeypatch):
    """PEFT's older adapter_model.bin, and an adapter named by hub id (its snapshot in the local hub cache, read
    offline), serve the same adapter as its safetensors folder: PEFT's merged model's tokens and logprobs."""
    import huggingface_hub.constants

    base, adapters, refs = lora_setup
    rank, alpha, targets, rslora = ADAPTERS["attn"]
    pickled = _make_adapter(base, tmp_path / "pickled", rank, alpha, targets, rslora, seed=0, safe=False)
    assert sorted(p.name for p in Path(pickled).iterdir() if p.name.startswith("adapter_model")) == [
        "adapter_model.bin"
    ]
    repo = tmp_path / "hub" / "models--team--attn-adapter"
    shutil.copytree(adapters["attn"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    llm = _llm(base)
    out = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        _params(),
        use_tqdm=False,
        lora_request=[LoRARequest("pickled", 1, pickled), LoRARequest("hub", 2, "team/attn-adapter"), None],
    )
    _check(out, [refs["attn"][0], refs["attn"][1], refs[None][2]])
    not_tensors = tmp_path / "not_tensors"
    shutil.copytree(pickled, not_tensors)
    torch.save({"base_model.model.x.lora_A.weight": "text"}, not_tensors / "adapter_model.bin")
    cases = {
        "team/not-cached": "could not be fetched from the Hugging Face hub",
        str(not_tensors): "not a plain tensor checkpoint",
    }
    _expect_refused(llm, cases, first_id=10)


def test_an_unloaded_adapter_is_freed_once_its_last_request_finishes(lora_setup):
    """`release_lora` (a served /v1/unload_lora_adapter): an adapter in use keeps its host copy and device slot
    until its last request finishes, and that request's tokens are PEFT's; an unused one is freed at once."""
    base, adapters, refs = lora_setup
    llm = _llm(base, max_loras=2)
    engine, manager = llm.llm_engine, llm.llm_engine.runner.lora
    attn, mlp = LoRARequest("attn", 1, adapters["attn"]), LoRARequest("mlp", 2, adapters["mlp"])
    engine.add_lora(mlp)
    engine.add_request("a", PROMPTS[0], _params(), lora_request=attn)
    engine.step()
    engine.release_lora(attn.lora_int_id)
    engine.release_lora(mlp.lora_int_id)
    assert engine.list_loras() == {1} and 2 not in manager._host and 2 not in manager._slots
    outputs = {}
    while engine.has_unfinished_requests():
        assert 1 in manager._host and 1 in manager._slots  # the running request still reads its adapter
        outputs.update({out.request_id: out for out in engine.step() if out.finished})
    assert not engine.list_loras() and not manager._host and set(manager._slots) == {None}
    _check([outputs["a"]], refs["attn"][:1])


def test_load_inplace_reads_a_changed_folder_again_and_no_block_of_the_old_weights_is_hit(lora_setup, tmp_path):
    """vLLM's `LoRARequest(..., load_inplace=True)`: the folder's files changed (here: another adapter's copied over
    it); the same request without the flag keeps the weights read first, with it the new ones run — and the prompts'
    cached blocks, computed under the old weights, are not hit. While a request of the id runs, a read in place is
    refused (it would change that request's output midway). After `remove_lora` the id is read anew, and the blocks
    cached under it before are not hit either."""
    base, adapters, refs = lora_setup
    folder = tmp_path / "changing"
    shutil.copytree(adapters["attn"], folder)
    llm = _llm(base, max_loras=1)
    long = [[(5 * i + j) % 500 + 3 for j in range(40)] for i in range(2)]  # two full 16-token blocks each
    long_refs = {name: _reference(base, adapters[name], long) for name in ("attn", "all")}
    prompts = [{"prompt_token_ids": p} for p in long]
    request = LoRARequest("changing", 1, str(folder))
    _check(llm.generate(prompts, _params(), use_tqdm=False, lora_request=request), long_refs["attn"])
    shutil.rmtree(folder)
    shutil.copytree(adapters["all"], folder)
    _check(llm.generate(prompts, _params(), use_tqdm=False, lora_request=request), long_refs["attn"])  # as read
    hits = llm.engine.block_manager.prefix_hits
    inplace = LoRARequest("changing", 1, str(folder), load_inplace=True)
    _check(llm.generate(prompts, _params(), use_tqdm=False, lora_request=inplace), long_refs["all"])
    assert llm.engine.block_manager.prefix_hits == hits  # no block of the old weights hit
    _check(llm.generate(prompts, _params(), use_tqdm=False, lora_request=request), long_refs["all"])  # kept
    assert llm.engine.block_manager.prefix_hits > hits  # the new weights' own blocks are
    engine = llm.llm_engine
    engine.add_request("running", PROMPTS[0], _params(), lora_request=request)
    with pytest.raises(InvalidRequest, match="still has requests; load it in place when they finish"):
        engine.add_lora(inplace)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.add_lora(inplace)  # nothing runs with it now
    _check(llm.generate(prompts, _params(), use_tqdm=False, lora_request=request), long_refs["all"])  # blocks cached
    # Removed, the folder rewritten once more (the first adapter's files), then named again by the same request:
    # read from its files as they are now, and no block cached under the id before its removal is hit.
    engine.remove_lora(1)
    shutil.rmtree(folder)
    shutil.copytree(adapters["attn"], folder)
    hits = llm.engine.block_manager.prefix_hits
    _check(llm.generate(prompts, _params(), use_tqdm=False, lora_request=request), long_refs["attn"])
    assert llm.engine.block_manager.prefix_hits == hits


def test_a_prompt_refused_part_way_leaves_nothing_queued(lora_setup, tmp_path):
    """The third prompt's adapter is refused: the two queued before it are aborted (as in vLLM), so they neither
    run with the next generate() nor come back from it."""
    base, adapters, refs = lora_setup
    llm = _llm(base, max_loras=2)
    good = LoRARequest("attn", 1, adapters["attn"])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    bad = LoRARequest("nowhere", 2, str(tmp_path / "nowhere"))
    with pytest.raises(InvalidRequest, match="no such folder"):
        llm.generate(prompts, _params(), use_tqdm=False, lora_request=[good, good, bad])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequest, match="'prompt' or 'prompt_token_ids'"):  # a bad prompt the same way
        llm.generate([prompts[0], {"text": "x"}], _params(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate(prompts[:1], _params(), use_tqdm=False)
    _check(outputs, refs[None][:1])


def test_chat_takes_vllms_lora_request_in_vllms_place(lora_setup, tmp_path):
    """vLLM's chat(messages, sampling_params, use_tqdm, lora_request, chat_template, ...): the adapter given
    fourth runs the chat (PEFT's merged model gives the same tokens); a list gives one per conversation. vLLM's
    sixth parameter is one Pagoda does not have: from there on only keywords are taken."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base, adapters, refs = lora_setup
    folder = str(tmp_path / "with_tokenizer")
    shutil.copytree(base, folder)
    words = ["<unk>", "<s>", "</s>", "user", "assistant", "hello", "world"] + [f"w{i}" for i in range(10)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    # Every piece a known word: an unknown one is id 0, which PEFT's reference generate takes for padding.
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}assistant"
    tokenizer.save_pretrained(folder)
    llm = LLM(folder, dtype="float32", enable_lora=True, max_lora_rank=16, num_gpu_blocks_override=256)
    sql = LoRARequest("attn", 1, adapters["attn"])
    chats = [[{"role": "user", "content": "hello world w1 w2"}], [{"role": "user", "content": "w3 w4 hello"}]]
    (one,) = llm.chat(chats[0], _params(), False, sql)
    assert 0 not in one.prompt_token_ids
    _check([one], _reference(base, adapters["attn"], [one.prompt_token_ids]))
    assert one.outputs[0].token_ids != _reference(base, None, [one.prompt_token_ids])[0][0]  # the adapter ran
    both = llm.chat(chats, _params(), False, [None, sql], None, add_generation_prompt=True)
    _check(both[:1], _reference(base, None, [both[0].prompt_token_ids]))
    _check(both[1:], _reference(base, adapters["attn"], [both[1].prompt_token_ids]))
    with pytest.raises(TypeError):
        llm.chat(chats[0], _params(), False, sql, None, "string")  # type: ignore[misc]


def test_qwen2_with_biased_qkv_equals_peft_merged(tmp_path):
    """Qwen2's q/k/v carry biases: the adapter adds to the biased projection, the fused parts stay aligned."""
    base = build_tiny_model("qwen2", str(tmp_path / "base"))
    rank, alpha, targets, rslora = ADAPTERS["all"]
    adapter = _make_adapter(base, tmp_path / "all", rank, alpha, targets, rslora, 11)
    llm = _llm(base, max_loras=1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    request = LoRARequest("all", 1, adapter)
    outputs = llm.generate(prompts + prompts, _params(), use_tqdm=False, lora_request=[request] * 3 + [None] * 3)
    _check(outputs[:3], _reference(base, adapter))
    _check(outputs[3:], _reference(base, None))


def test_qwen2_vl_language_model_equals_peft_merged(tmp_path):
    """Qwen2-VL: PEFT's target names reach the language model under transformers' nesting
    (`model.language_model.layers...`), and the vision tower, whose projections have other names, is untouched."""
    import transformers

    from tests.conftest import tiny_qwen2vl_config

    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(tiny_qwen2vl_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():  # random init leaves logits flat; sharpen them so greedy is robust
        model.lm_head.weight.mul_(30)
    base = tmp_path / "base"
    model.save_pretrained(base)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION + MLP, lora_dropout=0.0)
    adapted = peft.get_peft_model(transformers.Qwen2VLForConditionalGeneration.from_pretrained(base), config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                assert "visual" not in name
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    adapted.save_pretrained(tmp_path / "adapter")
    expected = _greedy(adapted.merge_and_unload().eval(), PROMPTS)
    llm = _llm(str(base), max_loras=1)
    request = LoRARequest("vl", 1, str(tmp_path / "adapter"))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    _check(llm.generate(prompts, _params(), use_tqdm=False, lora_request=request), expected)


YUAN_TARGETS = ATTENTION + ["up_proj", "gate_proj", "down_proj"]
# M32: each expert's w1 ([activated | linear] in one tensor, two parts of one fused layer here) and w2, and the
# attention router's query/key/value.
YUAN_M32_TARGETS = ATTENTION + ["w1", "w2", "query", "key", "value"]


def yuan_adapter_and_merged(
    out: Path, rank: int = 4, alpha: int = 8, seed: int = 0, fixture: str = "yuan2-tiny"
) -> tuple[str, str]:
    """A PEFT folder on a tiny Yuan2 (all its linear projections; the M32's experts and router too) and the
    checkpoint with the adapter merged into the weights, W + (alpha / r)·B·A in the checkpoint's own tensors
    (q_proj/k_proj rows, an expert's whole w1), as no modeling code is shipped for PEFT to load Yuan2 itself."""
    base = FIXTURES / fixture
    targets = YUAN_M32_TARGETS if "m32" in fixture else YUAN_TARGETS
    weights = safetensors.torch.load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    adapter, merged = {}, dict(weights)
    for name, w in weights.items():
        module = name[: -len(".weight")]
        if ".layers." in name and name.endswith(".weight") and module.rpartition(".")[2] in targets:
            a = torch.randn(rank, w.shape[1], generator=g) * 0.3
            b = torch.randn(w.shape[0], rank, generator=g) * 0.3
            adapter[f"base_model.model.{module}.lora_A.weight"] = a
            adapter[f"base_model.model.{module}.lora_B.weight"] = b
            merged[name] = w + (alpha / rank) * b @ a
    (out / "adapter").mkdir(parents=True)
    safetensors.torch.save_file(adapter, str(out / "adapter" / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets}
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    shutil.copytree(base, out / "merged", ignore=shutil.ignore_patterns("*.safetensors"))
    safetensors.torch.save_file(merged, str(out / "merged" / "model.safetensors"))
    return str(out / "adapter"), str(out / "merged")


@pytest.mark.parametrize("fixture", ["yuan2-tiny", "yuan2-m32-tiny"])
def test_yuan2_fused_qk_equals_the_merged_checkpoint(tmp_path, fixture):
    """Yuan2's q_proj and k_proj rows interleave by head in its fused qk projection: an adapter's B rows land
    there as the weights' rows do (the two ranks stacked). The M32's experts run on the tokens routed to them,
    each adapted by its token's adapter, and an expert's w1 adapter covers both its parts. Against the merged
    checkpoint (greedy tokens and logprobs), with the base model in the same batch giving the goldens."""
    adapter, merged = yuan_adapter_and_merged(tmp_path, fixture=fixture)
    golden = json.loads((FIXTURES / fixture / "golden.json").read_text())["cases"]
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in golden]
    plain = LLM(merged, skip_tokenizer_init=True, dtype="float32")
    expected = [
        (o.outputs[0].token_ids, [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in plain.generate(prompts, _params(), use_tqdm=False)
    ]
    llm = _llm(str(FIXTURES / fixture), max_loras=1, max_lora_rank=4)
    request = LoRARequest("yuan", 1, adapter)
    outputs = llm.generate(
        prompts + prompts, _params(), use_tqdm=False, lora_request=[request] * len(prompts) + [None] * len(prompts)
    )
    _check(outputs[: len(prompts)], expected)
    assert [o.outputs[0].token_ids for o in outputs[len(prompts) :]] == [c["greedy_16"][:MAX_TOKENS] for c in golden]
    assert [t for t, _ in expected] != [c["greedy_16"][:MAX_TOKENS] for c in golden]  # the adapter changes them
