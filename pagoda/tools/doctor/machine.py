"""Doctor's checks of the machine: CUDA and each GPU's free memory, bfloat16, free disk beside the model, the
server port, /dev/shm for tensor parallelism."""

from __future__ import annotations

import errno
import os
import shutil
import socket

from pagoda import envs
from pagoda.config.engine import gpu_count_problem
from pagoda.tools.doctor.check import Check, State, format_size

_DISK_FACTOR = 1.5


_SHM_MIN_BYTES = 1 << 30


def check_disk(state: State) -> Check:
    folder = state.folder or "."
    weights = state.weights_bytes
    free = shutil.disk_usage(folder).free
    need = int(_DISK_FACTOR * weights)
    if free < need:
        return Check(
            "disk",
            "warn",
            f"{format_size(free)} free on the model's filesystem, less than {_DISK_FACTOR}× the weights "
            f"({format_size(weights)})",
            "free space there: compile caches, logs and re-downloads need room next to the model",
        )
    return Check("disk", "ok", f"{format_size(free)} free (weights {format_size(weights)})", None)


def check_cuda(state: State, device: str, tp: int, pp: int = 1, backend: str = "mp") -> list[Check]:
    """CUDA, the GPU count for the tp x pp ranks (one GPU each) and each GPU's free memory, bfloat16."""
    import torch  # lazy: torch (`pagoda` starts without it)

    visible = envs.CUDA_VISIBLE_DEVICES.value
    if device == "cpu" or visible in ("", "-1"):
        why = "--device cpu" if device == "cpu" else f"CUDA_VISIBLE_DEVICES={visible!r}"
        return [Check("cuda", "ok", f"running on CPU ({why})", None)]
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        detail = f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
        fix = "check `nvidia-smi`, CUDA_VISIBLE_DEVICES and that torch is a CUDA build; or run on CPU with --device cpu"
        if device == "cuda":
            return [Check("cuda", "FAIL", detail + ", but --device cuda was asked for", fix)]
        return [Check("cuda", "warn", detail + ": Pagoda will run on the CPU", fix)]
    count = torch.cuda.device_count()
    ranks = tp * pp
    out = [Check("cuda", "ok", f"torch {torch.__version__}, CUDA {torch.version.cuda}, {count} GPU(s) visible", None)]
    problem = gpu_count_problem(tp, pp, count)  # serve's own refusal (config/engine.py), in its words
    if problem is not None and backend == "ray":
        out.append(
            Check("gpus", "ok", f"{count} visible here; Ray places the {ranks} ranks on its cluster's GPUs", None)
        )
    elif problem is not None:
        out.append(Check("gpus", "FAIL", *problem))
    per_gpu = state.weights_bytes / max(ranks, 1)
    for i in range(count):
        name = torch.cuda.get_device_name(i)
        free, total = torch.cuda.mem_get_info(i)
        detail = f"{name}: {format_size(free)} free of {format_size(total)}"
        if i < ranks and free < per_gpu:
            out.append(
                Check(
                    f"gpu {i}",
                    "warn",
                    f"{detail}, less than this GPU's share of the weights ({format_size(per_gpu)})",
                    "free the GPU, raise --tensor-parallel-size, or use --dtype bfloat16 if the checkpoint is float32",
                )
            )
        elif free < 0.9 * total:
            out.append(
                Check(
                    f"gpu {i}",
                    "warn",
                    f"{detail}: other processes hold {format_size(total - free)}",
                    "stop them or lower --gpu-memory-utilization",
                )
            )
        else:
            out.append(Check(f"gpu {i}", "ok", detail, None))
    dtype = str(state.hf_config.get("torch_dtype") or state.hf_config.get("dtype") or "").replace("torch.", "")
    if torch.cuda.is_bf16_supported():
        out.append(Check("bf16", "ok", "bfloat16 is supported", None))
    elif dtype == "bfloat16" or not dtype:
        out.append(
            Check("bf16", "warn", "this GPU does not support bfloat16, the checkpoint's dtype", "pass --dtype float16")
        )
    else:
        out.append(Check("bf16", "ok", f"bfloat16 unsupported, checkpoint dtype is {dtype}", None))
    return out


def check_port(host: str, port: int) -> Check:
    if port == 0:
        return Check("port", "ok", "port 0: the system picks a free port", None)
    if not 0 < port < 65536:
        return Check("port", "FAIL", f"port {port} is out of range", "pick --port between 1 and 65535")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return Check("port", "FAIL", f"host {host!r} does not resolve ({exc})", "pass --host 0.0.0.0 or an address")
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As uvicorn binds: SO_REUSEADDR, so a port in TIME_WAIT from a previous run counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return Check(
                    "port",
                    "FAIL",
                    f"another process listens on port {port}",
                    f"pick --port (another port), or stop the process on {port} (`ss -ltnp 'sport = :{port}'`)",
                )
            if exc.errno in (errno.EACCES, errno.EPERM):
                return Check("port", "FAIL", f"no permission to bind port {port}", "pick --port above 1023")
            return Check(
                "port",
                "FAIL",
                f"cannot bind {host}:{port} ({exc.strerror or exc})",
                "pick --port and --host that this machine can bind",
            )
    return Check("port", "ok", f"{host}:{port} is free", None)


def check_shm() -> Check:
    path = "/dev/shm"
    if not os.path.isdir(path):
        return Check(
            "/dev/shm",
            "warn",
            "/dev/shm does not exist; NCCL needs shared memory for tensor parallelism",
            "run the container with --ipc=host or --shm-size=16g",
        )
    st = os.statvfs(path)
    total = st.f_frsize * st.f_blocks
    if total < _SHM_MIN_BYTES:
        return Check(
            "/dev/shm",
            "warn",
            f"/dev/shm is {format_size(total)}, below 1 GiB: NCCL may crash with tensor parallelism",
            "run the container with --ipc=host or --shm-size=16g",
        )
    return Check("/dev/shm", "ok", f"{format_size(total)} ({format_size(st.f_frsize * st.f_bavail)} free)", None)
