"""Generate text for one prompt with one method; prints the text to stdout, stats to stderr.

Run:
    python -m treegraft.generate pair=qwen-coder-1.5b__0.5b method=ar \
        prompt="Write a Python function that checks whether a number is prime." max_new_tokens=128
    python -m treegraft.generate pair=smollm2-135m__self prompt_file=my_prompt.txt runtime=float32_packed
    python -m treegraft.generate pair=tiny-random chat_template=false prompt="hello" temperature=0.8 seed=3
    python -m treegraft.generate pair=qwen-coder-1.5b__0.5b method=all_mid tree.budget=auto prompt="..."
    python -m treegraft.generate pair=qwen-coder-1.5b__0.5b method=fixed stream=true prompt="..."   # text as it arrives
    python -m treegraft.generate pair=qwen-coder-1.5b__0.5b engine=llama_cpp method=all_mid prompt="..."  # GGUF on llama.cpp
    python -m treegraft.generate pair=qwen-coder-1.5b__0.5b method=fixed small=self_draft prompt="..."  # neural small drafter

Methods (conf/method/): ar, all_small, all_mid, fixed, all_call, no_nondestructive,
no_expanded_selection, csd, hf_assisted, hf_prompt_lookup. Small drafters of the tree methods (conf/small/):
ngram (default), self_draft (the middle drafter's first layers), model options such as qwen3-0.6b.

Only the generated text goes to stdout, so two methods' outputs can be compared with `diff`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from .config import CONF_DIR, check_config_choices


def read_prompt(cfg: DictConfig) -> str:
    if (cfg.prompt is None) == (cfg.prompt_file is None):
        raise ValueError("give exactly one of prompt=... or prompt_file=<path>")
    if cfg.prompt_file is not None:
        path = Path(cfg.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompt_file {str(path)!r} does not exist")
        return path.read_text()
    return str(cfg.prompt)


class TextStream:
    """Prints generated text as tokens arrive (one turn's accepted tokens at a time), holding back an
    incomplete UTF-8 character, so that what reaches stdout is exactly the decoded whole."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out if out is not None else sys.stdout
        self.tokens: list[int] = []
        self.printed = ""

    def put(self, new: list[int]) -> None:
        self.tokens.extend(new)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        safe = text[: text.index("\ufffd")] if "\ufffd" in text else text
        if safe.startswith(self.printed) and len(safe) > len(self.printed):
            self.out.write(safe[len(self.printed):])
            self.out.flush()
            self.printed = safe

    def end(self, text: str) -> None:
        """Print the rest of the final ``text`` (what the non-streamed run prints) and the newline."""
        if not text.startswith(self.printed):  # never expected for prefix-stable decoding; keep stdout whole
            raise RuntimeError("streamed text is not a prefix of the final text")
        self.out.write(text[len(self.printed):] + "\n")
        self.out.flush()


def run(cfg: DictConfig) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    # stderr carries exactly one stats line: no loading bars or advisory warnings from transformers
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    from .data import format_prompt
    from .decoding import SamplingConfig
    from .decoding.methods import LEARNED_METHODS, TREE_METHODS, find_artifacts, load_learned_scheduler
    from .front import decoder_for, engines_of, load_engine_pair
    from .settings import RunSettings

    text = read_prompt(cfg)
    if not text.strip():
        raise ValueError("empty prompt: give a non-empty prompt or prompt_file")
    settings = RunSettings.of(cfg)  # a bad tree or small drafter setting: one line, before any model loads
    spec = instantiate(cfg.pair)
    method = cfg.method.name
    pair = load_engine_pair(spec, cfg, log=lambda line: print(line, file=sys.stderr))
    runtime = pair.runtime
    tokenizer = pair.tokenizer
    prompt = format_prompt(tokenizer, text) if cfg.chat_template else text
    prompt_ids = tokenizer(prompt, add_special_tokens=not cfg.chat_template).input_ids
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
    torch.manual_seed(cfg.seed)

    scheduler = None
    if method in LEARNED_METHODS:  # method.artifacts=auto: the newest policy fitted on this pair and engine
        artifacts = cfg.method.artifacts
        if str(artifacts) == "auto":
            artifacts = find_artifacts(method, spec.name, engines_of(pair).name, cfg.paths.output_dir)
            print(f"[{method}] policy from {artifacts}", file=sys.stderr)
        scheduler = load_learned_scheduler(method, artifacts)
    small = settings.small
    if small is not None and small.get("name", "ngram") != "ngram" and method not in TREE_METHODS:
        raise ValueError(f"small={small['name']} chooses a tree method's small drafter; method {method} has none")
    decoder = decoder_for(method, pair, settings.tree, sampling, scheduler, cfg.paths.cache_dir,
                          small=small if method in TREE_METHODS else None)
    if scheduler is not None:  # the learned policy's runtime context (ms per target / middle forward)
        decoder.warm_up(prompt_ids, 4)
    stream = TextStream(tokenizer) if cfg.stream else None
    result = decoder.generate(prompt_ids, cfg.max_new_tokens, on_tokens=stream.put if stream else None)
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    if stream is not None:
        stream.end(text)
    else:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    stats = (
        f"[{method}] pair={spec.name} new_tokens={result.new_tokens} prompt_tokens={result.prompt_tokens} "
        f"time={result.wall_time_s:.2f}s tokens/s={result.tokens_per_s:.2f} stop={result.stop_reason} runtime={runtime}"
    )
    if result.turns:
        mean_al = sum(t["accepted"] for t in result.turns) / len(result.turns)
        stats += f" turns={len(result.turns)} mean_AL={mean_al:.2f}"
    print(stats, file=sys.stderr)
    return 0


def cli(cfg: DictConfig) -> int:
    """:func:`run` as the command line runs it: a bad input is one line on stderr and exit status 2."""
    from .models import ModelLoadError, TokenizerMismatchError
    from .engines.llama_cpp import LlamaCppError
    from .models.runtime import RuntimeUnavailable

    try:
        return run(cfg)
    except (ModelLoadError, TokenizerMismatchError, RuntimeUnavailable, LlamaCppError, ValueError,
            FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="generate")
def main(cfg: DictConfig) -> None:
    code = cli(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    check_config_choices()
    main()
