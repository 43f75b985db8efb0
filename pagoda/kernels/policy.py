"""The row thresholds that pick a kernel, in one table: below or at each bound the fast path runs, above
it the general one. Callers read them here at call time (`policy.GEMV_MAX_ROWS`, never a copy taken at
import), so a test can move one bound with monkeypatch. docs/performance.md ("Fast paths") quotes
this table; the measurements behind each number are there too.

Pure constants: importing this module imports neither Triton nor any kernel.
"""

from __future__ import annotations

# Matmuls (`layers/linear.py`) of at most this many rows run the Triton GEMV (`kernels/gemv.py`), more
# go to cuBLAS: at one row the GEMV beats cuBLAS on every Yuan2-2B matmul, from two rows on cuBLAS wins
# for most (`benchmarks/kernels/gemv_sweep.py`).
GEMV_MAX_ROWS = 1

# Matmuls whose K fits one GEMV tile (K ≤ `gemv.MAX_BLOCK_K`) take the GEMV's row loop (the weight tile read once,
# the rows reduced against it in turn, each exactly as a one-row call does) up to a row count that shrinks as the
# weight grows: (largest weight in elements, most rows), smallest weights first. Each program re-reads every row of
# x, so the loop's cost grows with the rows while cuBLAS's hardly does. In `benchmarks/kernels/gemv_sweep.py
# --rows 1,2,4,8,16` it beat cuBLAS at 4 rows on every weight of up to 4.2M elements, at 2 rows on every weight of
# up to 34M but SmolLM2-135M's head (0.93x), and lost at 8 rows on most. A speculative verification of 3 proposals
# (4 rows) then costs little more than a decode step, and its rows get the decode step's values bit for bit.
GEMV_LOOP_ROWS = ((5 * 2**20, 4), (36 * 2**20, 2))

# FP8 linears (`layers/quantization/fp8.py`) of at most this many rows keep the activations in the model
# dtype and widen the e4m3 weights inside the GEMV (W8A16); more rows quantize the activations for
# cuBLASLt's fp8 matmul (W8A8). At two rows the fp8 GEMV is 0.74-1.2x of the bf16 one
# (`benchmarks/kernels/fp8_linear_sweep.py`).
FP8_GEMV_MAX_ROWS = 1

# AWQ/GPTQ matmuls (`kernels/int4_gemm.py`) of at most this many rows run the dequantizing GEMV, more the
# `tl.dot` GEMM; at most `int4_gemm.GEMV_ROWS`, the rows the GEMV kernel holds. Where the two kernels
# cross is what `benchmarks/kernels/int4_gemm_bench.py` times.
INT4_GEMV_MAX_ROWS = 4

# A GGUF's 4-bit layers on the CPU (`layers/quantization/cpu_int4.py`): matmuls of at most this many rows
# run PyTorch's CPU int4 kernel, more dequantize the layer to bf16 for one dense matmul. The dequantization
# costs about what the int4 kernel does at 50-60 rows (the embedded model on 2 cores: batch 32 went
# 132 → 240 tok/s when this bound went from 16 to 64, batch 16 unchanged).
CPU_INT4_MAX_ROWS = 64

# The bf16 LM head beside those layers (`cpu_int4.Bf16LMHead`) recomputes this many of each row's largest
# logits in float32: greedy decoding and the top log-probabilities read only those, and bf16's rounding
# moves a logit by far less than the gap between the first and the eighth candidate.
CPU_BF16_HEAD_EXACT = 8

# That head multiplies steps of at most this many rows by its int8 copy (`_weight_int8pack_mm`, bf16 activations),
# more by its bf16 copy: the int8 kernel reads half the bytes but its time grows with the rows, the bf16 GEMM's
# hardly; they cross between 4 and 16 rows on the embedded model's head (docs/performance.md has the timings).
CPU_INT8_HEAD_MAX_ROWS = 4

# The PyTorch attention on the CPU (`layers/torch_attention.py`) attends decode rows in place (one call per row over
# a view of its cache blocks) when a step has at most this many, each one run of blocks; more are gathered
# into one padded batch, whose single call costs less than that many calls.
CPU_KV_VIEW_MAX_ROWS = 3

# Steps (eager, or a CUDA-graph bucket) of at most this many tokens launch their kernels with
# programmatic dependent launch (`kernels/pdl.py`, `dispatch.pdl_for_rows`): it shortens a batch-1
# step's kernel chain, but at batch 256 waiting programs hold SM slots the running kernel needs and the
# decode step is slower (`benchmarks/h200.py`).
PDL_MAX_ROWS = 64

# The LoRA shrink and expand (`kernels/lora.py`) launch with PDL in launches of at most this many tokens, whatever
# the step's rule above: each waits for its predecessor (the layer's cuBLAS matmul, or the shrink) with its tile's
# bookkeeping (and the expand its B tile) already loaded. 16 rank-16 adapters on a Llama-3-8B shape
# (`benchmarks/lora_gpu.py`): 1.01x tokens/s at 64 rows and at 256; larger launches are not measured.
LORA_PDL_MAX_ROWS = 256

# A decoder layer's adapters' A matrices are stacked under its weight (`lora/layers.py`, `LoRASlots.stack_under`)
# when their rows (parts x slots x max rank) come to at most this fraction of the layer's output rows: launches of
# at most LORA_STACKED_MAX_TOKENS tokens then get every slot's shrink as extra output columns of the layer's own
# matmul, and only the expand is a launch of its own. The extra columns cost the matmul a few per cent, where the
# shrink launch they replace cost about as much as the expand (`benchmarks/lora_gpu.py`, 16 rank-16 adapters on a
# Llama-3-8B shape); past this fraction the matmul pays for slots a step seldom fills.
LORA_STACKED_MAX_EXTRA = 0.25
LORA_STACKED_MAX_TOKENS = 256

# Yuan2 decode steps of at most this many rows run v_proj on a side stream (`models/yuan.py`,
# `layers/side_stream.py`): it overlaps at batch 1 and is slower at batch 256 (`benchmarks/h200.py`).
SIDE_STREAM_MAX_ROWS = 32

# Mixed steps (prefill chunks + decodes) are replayed from CUDA graphs in token buckets up to this many
# tokens (`worker/graph_runner.py`); larger steps are prefill-heavy, and their GPU time hides the host's
# launch time anyway.
MIXED_GRAPH_MAX_TOKENS = 2048
