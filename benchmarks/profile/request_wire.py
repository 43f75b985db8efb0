"""Host time of one image request crossing from an API process to the engine core (CPU only).

    python benchmarks/profile/request_wire.py [--sizes 640x480 1000x750 1920x1080] [--requests 200] [--json FILE]

Each request is an `AddRequest` shaped as the API process makes it for one image of that size (Qwen2-VL's
levels: one uint8 row of 3 x 14 x 14 per patch, the normalising table, M-RoPE positions for ~1,000 prompt
tokens). Two ways over a local IPC socket, as the serving processes use them: `pickled` (`send_pyobj` /
`recv_pyobj`: the request pickled in one frame) and `out_of_band` (`core_process.to_frames` / `from_frames`:
the arrays as frames of their own, sent and received without a copy). The sender's time is measured on its
own thread; the receiver's with the requests already queued, so it is the core's cost to take one in, not a
wait for it. Prints µs per request for each side.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from pagoda.engine.core_process import AddRequest, from_frames, to_frames
from pagoda.inputs import MultiModalInputs, MultiModalItem
from pagoda.sampling_params import SamplingParams

PATCH = 14
MERGE = 2


def image_request(width: int, height: int, index: int) -> AddRequest:
    h = max(MERGE, round(height / (PATCH * MERGE)) * MERGE)  # patch rows and columns, multiples of the merge
    w = max(MERGE, round(width / (PATCH * MERGE)) * MERGE)
    rng = np.random.default_rng(index)
    pixels = rng.integers(0, 256, (h * w, 3 * PATCH * PATCH), dtype=np.uint8)
    tokens = h * w // MERGE**2
    item = MultiModalItem("image", pixels, (1, h, w), 5, tokens, index.to_bytes(16, "little"),
                          rng.random((3, 256)).astype(np.float32), 2)  # fmt: skip
    prompt = list(range(tokens + 30))
    mm = MultiModalInputs([item], rng.integers(0, 1000, (3, len(prompt))).astype(np.int64), 0, {"image": tokens})
    return AddRequest(f"r{index}", prompt, SamplingParams(max_tokens=128), None, True, time.time(), mm)


def measure(requests: list[AddRequest], way: str, address: str) -> tuple[float, float]:
    """(sender µs, receiver µs) per request."""
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind(address)
    push.connect(address)
    sent: list[float] = []

    def send() -> None:
        start = time.perf_counter()
        for request in requests:
            if way == "pickled":
                push.send_pyobj(request)
            else:
                push.send_serialized(request, to_frames, copy=False)
        sent.append(time.perf_counter() - start)

    sender = threading.Thread(target=send)
    sender.start()
    sender.join()
    time.sleep(0.5)  # every request queued on the receiving side
    start = time.perf_counter()
    for _ in requests:
        got = pull.recv_pyobj() if way == "pickled" else pull.recv_serialized(from_frames, copy=False)
        assert got.mm_inputs.items[0].pixel_values.shape == requests[0].mm_inputs.items[0].pixel_values.shape
    received = time.perf_counter() - start
    push.close(linger=0)
    pull.close(linger=0)
    context.term()
    return 1e6 * sent[0] / len(requests), 1e6 * received / len(requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["640x480", "1000x750", "1920x1080"])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    print("| size | pixel MB | way | send µs | receive µs |")
    print("| --- | ---: | --- | ---: | ---: |")
    for size in args.sizes:
        width, height = map(int, size.split("x"))
        requests = [image_request(width, height, i) for i in range(args.requests)]
        mb = requests[0].mm_inputs.items[0].pixel_values.nbytes / 1e6
        for way in ("pickled", "out_of_band"):
            runs = [measure(requests, way, f"ipc:///tmp/request_wire_{way}_{r}") for r in range(args.rounds)]
            send, receive = (float(np.median([run[i] for run in runs])) for i in (0, 1))
            rows.append({"size": size, "pixel_mb": mb, "way": way, "send_us": send, "receive_us": receive})
            print(f"| {size} | {mb:.2f} | {way} | {send:.0f} | {receive:.0f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
