"""Write a copy of a GGUF with its matrices stored in another llama.cpp block format, for measuring how the CPU
path serves files of that format (the default model ships as Q4_1; users also download Q8_0 and Q4_0 files).

    python benchmarks/requantize_gguf.py OUT.gguf [--gguf IN.gguf] [--type Q8_0]

Every 2-D tensor whose rows are whole 32-value blocks is dequantized by the `gguf` package and quantized again
with its quantizer (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); the metadata, the tokenizer and every other tensor are copied
as they are. The result is the same model at the new format's precision (a Q4_1 file made Q8_0 keeps the 4-bit
values to within Q8_0's rounding), which is what a speed comparison of formats needs.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    from pagoda.models.gguf_checkpoint import default_gguf_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--gguf", default=None, help="default: the embedded model's GGUF")
    ap.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
    args = ap.parse_args()
    target = gguf.GGMLQuantizationType[args.type]
    reader = gguf.GGUFReader(args.gguf or default_gguf_path())
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(args.out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    changed = 0
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # row-major
        if len(shape) == 2 and shape[1] % 32 == 0:
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
            writer.add_tensor(tensor.name, quantize(values, target), raw_dtype=target)
            changed += 1
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}: {changed} matrices as {args.type}")


if __name__ == "__main__":
    main()
