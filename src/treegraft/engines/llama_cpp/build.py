"""Build llama-cpp-python from its source package, with the batch-invariance patch (what `make setup` runs).

Run:
    .venv/bin/python -m treegraft.engines.llama_cpp.build          # or: make llamacpp

Downloads the pinned source package from PyPI, applies :data:`PATCHES` (its vendored ggml, one build option), and
installs it into the running interpreter's environment (library only: no tools, no examples, no
multimodal library; about 3 minutes on 2 cores). A failed step is one line on stderr and exit status 1.

Why each build choice:
- ``-DGGML_NATIVE=ON`` with ``-mno-amx-*``: the kernels for this CPU, but never ggml's AMX buffer type,
  which crashes in ``ggml_backend_amx_mul_mat`` on Q4_K_M models on Xeons with AMX.
- llamafile's sgemm and the weight repacking stay compiled in: they are the stock fast kernels that
  ``exact=false`` runs. The exact default switches them off at run time (the patch below and
  ``use_extra_bufts=false`` at model load).
- The patch adds one process-wide switch, ``ggml_cpu_set_batch_invariant``, that routes every op
  through ggml's own reference paths (``use_ref``: no flash-attention split-KV or tiled path, no tiled
  K-quant matmul) and skips llamafile's sgemm. With it, a token's logits do not depend on how many
  tokens share its batch or where its KV cells sit: a tree verified in one batch gives bit for bit
  the logits of one-token decoding.
- In that mode the matrix products of the K-quants (Q4_K, Q6_K) are our own (patches/bi_kquants_x86.c):
  exact integer sums and one fixed float order per output, a one-column kernel and a many-column one
  (dpbusd, columns in SIMD lanes) that give the same bits, so wide batches cost less than a column at a
  time. Their float order is not vec_dot's: exact decoding's logits differ from stock's in the last bits.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS = [
    "-DGGML_NATIVE=ON",
    f"-DCMAKE_C_FLAGS={AMX_OFF}",
    f"-DCMAKE_CXX_FLAGS={AMX_OFF}",
    "-DLLAVA_BUILD=OFF",  # no multimodal library
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
]

_SWITCH_C = """
// treegraft: batch-invariant mode. One process-wide switch (env GGML_CPU_BATCH_INVARIANT=1 or
// ggml_cpu_set_batch_invariant) that makes every op take ggml's reference paths (use_ref) and skip
// llamafile's sgemm, so that a row's result does not depend on the batch it is computed in.
static atomic_bool ggml_cpu_batch_invariant_flag = false;

void ggml_cpu_set_batch_invariant(bool on) {
    atomic_store(&ggml_cpu_batch_invariant_flag, on);
}

bool ggml_cpu_get_batch_invariant(void) {
    return atomic_load(&ggml_cpu_batch_invariant_flag);
}
"""

GGML = "vendor/llama.cpp/ggml/"

# the batch-invariant matrix products (inserted into ggml_compute_forward_mul_mat_one_chunk): the type's own
# product where it has one (the K-quants: patches/bi_kquants_x86.c), else its multi-column kernel
_MULTI_LOOP_C = """
    // treegraft: batch-invariant mode takes the type's batch-invariant product where there is one (2-D case),
    // else its multi-column kernel
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
    const bool tg_plain_2d = params->use_ref && num_rows_per_vec_dot == 1 && ne12 == 1 && ne13 == 1;
    ggml_bi_mul_mat_t const bi_mul_mat = tg_plain_2d ? ggml_bi_mul_mat_for(type) : NULL;
    if (bi_mul_mat) {
        for (int64_t iir1 = ir1_start; iir1 < ir1_end; iir1 += blck_1) {
            const int64_t end1 = MIN(iir1 + blck_1, ir1_end);
            bi_mul_mat((int) ne00, (const char *) src0->data + ir0_start * nb01, nb01, (int) (ir0_end - ir0_start),
                       (const char *) wdata + iir1 * src1_col_stride, src1_col_stride, (int) (end1 - iir1),
                       (float *) ((char *) dst->data + iir1 * nb1) + ir0_start, nb1);
        }
        return;
    }
    ggml_vec_dot_multi_t const vec_dot_multi = tg_plain_2d ? ggml_vec_dot_multi_for(type) : NULL;
#else
    ggml_vec_dot_multi_t const vec_dot_multi = NULL;
#endif
    if (vec_dot_multi) {
        for (int64_t iir1 = ir1_start; iir1 < ir1_end; iir1 += blck_1) {
            const int64_t end1 = MIN(iir1 + blck_1, ir1_end);
            for (int64_t iir0 = ir0_start; iir0 < ir0_end; iir0 += blck_0) {
                const int64_t end0 = MIN(iir0 + blck_0, ir0_end);
                const char * src1_col = (const char *) wdata + iir1 * src1_col_stride;
                float * dst_col = (float *) ((char *) dst->data + iir1 * nb1);
                for (int64_t ir0 = iir0; ir0 < end0; ++ir0) {
                    vec_dot_multi(ne00, dst_col + ir0, nb1, (const char *) src0->data + ir0 * nb01,
                                  src1_col, src1_col_stride, (int) (end1 - iir1));
                }
            }
        }
        return;
    }
"""

# files appended whole to a file of the source package (path in the package, file beside this module)
APPENDS: list[tuple[str, str]] = [
    (GGML + "src/ggml-cpu/arch/x86/quants.c", "patches/multicol_x86.c"),
    (GGML + "src/ggml-cpu/arch/x86/quants.c", "patches/bi_kquants_x86.c"),
]

# (file in the source package, anchor text, replacement); each anchor must occur exactly once.
PATCHES: list[tuple[str, str, str]] = [
    # llama-cpp-python forces llama.cpp's `common` library on, which only its tools and the multimodal
    # library link; off, the build skips its heaviest sources (about a fifth of the build time)
    ("CMakeLists.txt",
     '    set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)\n',
     '    set(LLAMA_BUILD_COMMON ${LLAVA_BUILD} CACHE BOOL "Build llama.cpp common library" FORCE)\n'),
    (GGML + "include/ggml-cpu.h",
     "    GGML_BACKEND_API bool    ggml_is_numa(void); // true if init detected that system has >1 NUMA node\n",
     "    GGML_BACKEND_API bool    ggml_is_numa(void); // true if init detected that system has >1 NUMA node\n"
     "    // treegraft: batch-invariant mode (reference paths, no llamafile sgemm) for every op from now on\n"
     "    GGML_BACKEND_API void    ggml_cpu_set_batch_invariant(bool on);\n"
     "    GGML_BACKEND_API bool    ggml_cpu_get_batch_invariant(void);\n"
     "    // treegraft: outputs of the batch-invariant product of `type` over nc columns whose bits differ from\n"
     "    // the same product one column at a time (-1: none for this type); *deviation: its distance from vec_dot\n"
     "    GGML_BACKEND_API int     ggml_cpu_treegraft_multicol_check(enum ggml_type type, int n, int rows, int nc, uint32_t seed,\n"
     "                                                               float * deviation);\n"),
    (GGML + "src/ggml-cpu/ggml-cpu.c",
     "static bool ggml_cpu_disable_fusion = false;",
     _SWITCH_C + "\nstatic bool ggml_cpu_disable_fusion = false;"),
    (GGML + "src/ggml-cpu/ggml-cpu.c",
     "        /*.use_ref    =*/ cplan->use_ref,\n",
     "        /*.use_ref    =*/ cplan->use_ref || ggml_cpu_get_batch_invariant(),\n"),
    (GGML + "src/ggml-cpu/ggml-cpu.c",  # llamafile's sgemm tiles by batch size: not in the reference path
     "    const bool src1_cont = ggml_is_contiguous(src1);\n\n    if (src1_cont) {\n",
     "    const bool src1_cont = ggml_is_contiguous(src1);\n\n    if (src1_cont && !params->use_ref) {\n"),
    (GGML + "src/ggml-cpu/ggml-cpu.c",
     "#if GGML_USE_LLAMAFILE\n    if (src1->type != vec_dot_type) {\n",
     "#if GGML_USE_LLAMAFILE\n    if (src1->type != vec_dot_type && !params->use_ref) {\n"),
    # the batch-invariant matrix products (patches/bi_kquants_x86.c for Q4_K / Q6_K, patches/multicol_x86.c
    # for the 32-value block types, both appended to the x86 quants) and their use: in batch-invariant mode
    # a plain 2-D matrix product of a type that has one gives every output the bits of a batch of one
    (GGML + "src/ggml-cpu/quants.h",
     "// Dot product\n",
     "// treegraft: one weight row against nc <= 16 activation columns (outputs s + c*bs, columns vy + c*by);\n"
     "// each output has the bits the type's vec_dot gives that column alone\n"
     "typedef void (*ggml_vec_dot_multi_t)(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,\n"
     "                                     const void * GGML_RESTRICT vy, size_t by, int nc);\n"
     "ggml_vec_dot_multi_t ggml_vec_dot_multi_for(enum ggml_type type);\n"
     "// treegraft: the batch-invariant matrix product of a type (rows w + r*w_stride, r < nr, against columns\n"
     "// vy + c*y_stride, c < nc <= 16, into dst + c*dst_stride + r); every output has the bits of nc = 1\n"
     "typedef void (*ggml_bi_mul_mat_t)(int n, const char * GGML_RESTRICT w, size_t w_stride, int nr,\n"
     "                                  const char * GGML_RESTRICT vy, size_t y_stride, int nc,\n"
     "                                  float * GGML_RESTRICT dst, size_t dst_stride);\n"
     "ggml_bi_mul_mat_t ggml_bi_mul_mat_for(enum ggml_type type);\n\n"
     "// Dot product\n"),
    (GGML + "src/ggml-cpu/ggml-cpu.c",
     "    float tmp[32];\n",
     "    float tmp[32];\n" + _MULTI_LOOP_C),
    # the K-quant products interleave a chunk's columns once per chunk: chunks of 64 rows, not 16
    (GGML + "src/ggml-cpu/ggml-cpu.c",
     "    if (nr0 == 1 || nr1 == 1) {\n        chunk_size = 64;\n    }\n",
     "    if (nr0 == 1 || nr1 == 1) {\n        chunk_size = 64;\n    }\n"
     "#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)\n"
     "    if (params->use_ref && ne12 == 1 && ne13 == 1 && ggml_bi_mul_mat_for(src0->type) != NULL) {\n"
     "        chunk_size = 64;  // treegraft: see bi_kquants_x86.c\n"
     "    }\n"
     "#endif\n"),
    # a Qwen2 or Llama context with embeddings on and no pooling returns the final norm's hidden states without the
    # LM head (t_logits null: llama_decode then fills no logits): the middle drafter's own head reads only
    # its draft vocabulary, and the full head was a third of a one-row 0.5B call (HIDDEN_STATE_ARCHS)
    ("vendor/llama.cpp/src/models/qwen2.cpp",
     "    res->t_embd = cur;\n\n    // lm_head\n    cur = build_lora_mm(model.output, cur, model.output_s);\n\n"
     "    if (model.output_b != nullptr) {\n        cur = ggml_add(ctx0, cur, model.output_b);\n    }\n"
     "    cb(cur, \"result_output\", -1);\n    res->t_logits = cur;\n",
     "    res->t_embd = cur;\n\n"
     "    if (!(cparams.embeddings && pooling_type == LLAMA_POOLING_TYPE_NONE)) {  // treegraft: hidden states only\n"
     "    // lm_head\n    cur = build_lora_mm(model.output, cur, model.output_s);\n\n"
     "    if (model.output_b != nullptr) {\n        cur = ggml_add(ctx0, cur, model.output_b);\n    }\n"
     "    cb(cur, \"result_output\", -1);\n    res->t_logits = cur;\n"
     "    }\n"),
    ("vendor/llama.cpp/src/models/llama.cpp",
     "    if constexpr (!embed) {\n        // lm_head\n",
     "    if (!embed && !(cparams.embeddings && pooling_type == LLAMA_POOLING_TYPE_NONE)) {  // treegraft: hidden states only\n"
     "        // lm_head\n"),
    (GGML + "src/ggml-cpu/ggml-cpu.c",
     "            const char * env = getenv(\"GGML_CPU_DISABLE_FUSION\");\n",
     "            const char * inv = getenv(\"GGML_CPU_BATCH_INVARIANT\");\n"
     "            if (inv != NULL && atoi(inv) == 1) {\n"
     "                ggml_cpu_set_batch_invariant(true);\n"
     "            }\n"
     "            const char * env = getenv(\"GGML_CPU_DISABLE_FUSION\");\n"),
]


class BuildError(RuntimeError):
    pass


def _appended(name: str) -> str:
    return (Path(__file__).parent / name).read_text()


def patch_id() -> str:
    """A short digest of the build options and the patch set (recorded with every result)."""
    text = json.dumps([VERSION, CMAKE_ARGS, PATCHES, [(rel, _appended(name)) for rel, name in APPENDS]])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def apply_patches(source_dir: Path) -> None:
    for rel, anchor, new in PATCHES:
        path = source_dir / rel
        text = path.read_text()
        if text.count(anchor) != 1:
            raise BuildError(f"patch anchor not found exactly once in {rel} (llama-cpp-python {VERSION} expected): "
                             f"{anchor.strip().splitlines()[0]!r}")
        path.write_text(text.replace(anchor, new))
    for rel, name in APPENDS:
        path = source_dir / rel
        path.write_text(path.read_text() + _appended(name))


def _run(cmd: list[str], what: str, env: dict | None = None, log: Path | None = None) -> None:
    with open(log, "a") if log else open(os.devnull, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = ""
        if log and log.exists():
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            errors = [ln for ln in lines if "error" in ln.lower()]
            tail = (errors or lines or [""])[-1].strip()
        raise BuildError(f"{what} failed (exit {proc.returncode}){': ' + tail if tail else ''}; full log: {log}")


def installed_build() -> dict | None:
    """The stamp of the installed build (version, options, patch id), None if llama_cpp is absent or stock."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    stamp = Path(spec.origin).parent / "treegraft_build.json"
    return json.loads(stamp.read_text()) if stamp.is_file() else None


def build(work_dir: Path, jobs: int = 2, log: Path | None = None) -> dict:
    """Download, patch and install llama-cpp-python; returns the build stamp."""
    if shutil.which("cmake") is None:
        raise BuildError("cmake not found: install it (Debian: apt-get install cmake) to build llama.cpp")
    work_dir.mkdir(parents=True, exist_ok=True)
    log = log or work_dir / "build.log"
    log.write_text("")
    sdist = work_dir / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-binary", ":all:",
              "--no-deps", "-d", str(work_dir)], "downloading the llama-cpp-python source package", log=log)
    with tempfile.TemporaryDirectory(dir=work_dir, prefix="src-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = Path(tmp) / f"llama_cpp_python-{VERSION}"
        apply_patches(src)
        env = {**os.environ, "CMAKE_ARGS": " ".join(f'"{a}"' if " " in a else a for a in CMAKE_ARGS),
               "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
        _run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-cache-dir", str(src)],
             "building llama-cpp-python", env=env, log=log)
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise BuildError(f"llama-cpp-python was installed but cannot be imported from {sys.executable}")
    stamp = {"version": VERSION, "cmake_args": CMAKE_ARGS, "patch_id": patch_id(), "amx": "off"}
    (Path(spec.origin).parent / "treegraft_build.json").write_text(json.dumps(stamp, indent=1))
    return stamp


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=".venv/src/llama-cpp-python")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--force", action="store_true", help="rebuild even when the installed build is current")
    args = parser.parse_args()
    current = installed_build()
    if current and current.get("patch_id") == patch_id() and not args.force:
        print(f"llama-cpp-python {VERSION} (patch {patch_id()}) already built")
        return 0
    print(f"building llama-cpp-python {VERSION} (patch {patch_id()}, AMX off) with {args.jobs} jobs ...", flush=True)
    try:
        stamp = build(Path(args.work_dir), args.jobs)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"built llama-cpp-python {stamp['version']} (patch {stamp['patch_id']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
