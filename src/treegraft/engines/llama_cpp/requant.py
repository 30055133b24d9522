"""A GGUF file's weight matrices requantized to Q4_0, once, for the middle drafter's fast kernels.

The embedded 0.5B's rows are 896 values wide, too narrow for the K-quants' 256-value blocks, so its Q4_K_M file
holds Q5_0 matrices, which llama.cpp does not repack: every extra row of a call costs about a full one-row
call. Q4_0 is repacked into llama.cpp's interleaved many-row kernels. Requantizing reads each matrix back to
float32 and rounds it to Q4_0 (a second rounding: the drafter's distribution moves a little; it only steers
drafts, the target verifies every token). The output and embedding matrices keep their types: the drafter's own
head (:class:`~treegraft.engines.llama_cpp.head.VocabHead`) reads the output matrix, or the embedding matrix
where the two are tied, and the embedding is a row lookup whose size costs nothing per call.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["MIDDLE_WEIGHTS", "requantized"]

MIDDLE_WEIGHTS = ("file", "q4_0")  # engine.middle_weights: the file's own types, or requantized to Q4_0

_KEEP = ("output.weight", "token_embd.weight")
VERSION = 2  # in the file's name: a changed requantizer writes a new file

def requantized(path: str | os.PathLike, out_dir: str | os.PathLike, name: str | None = None) -> Path:
    """``<out_dir>/<name>.<digest>.q4_0.gguf`` (``name``: the file's stem by default; the digest of this
    requantizer's version and the source's path, size and mtime): ``path`` with every quantized 2-D matrix but the
    output and embedding matrices in Q4_0, written atomically the first time, then reused."""
    import hashlib

    import gguf

    path = Path(path)
    stat = path.stat()
    digest = hashlib.sha256(f"{VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:8]
    out = Path(out_dir) / f"{name or path.stem}.{digest}.q4_0.gguf"
    if out.is_file():
        return out
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=arch)
    if "general.alignment" in reader.fields:  # tensor offsets padded as the source's
        writer.add_custom_alignment(int(reader.alignment))
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.alignment") or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_Q4_0)
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    tensors = []
    for t in reader.tensors:
        data, qtype = np.asarray(t.data), t.tensor_type
        if qtype not in plain and t.name not in _KEEP and len(t.shape) == 2 and int(t.shape[0]) % 32 == 0:
            data = gguf.quantize(gguf.dequantize(data, qtype), gguf.GGMLQuantizationType.Q4_0)
            qtype = gguf.GGMLQuantizationType.Q4_0
        tensors.append((t.name, data, qtype))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    os.replace(tmp, out)
    return out
