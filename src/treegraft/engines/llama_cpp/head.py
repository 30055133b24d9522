"""The middle drafter's LM head on its draft vocabulary, applied in PyTorch to llama.cpp's hidden states.

llama.cpp's head multiplies every output row by all ~152k vocabulary rows (a third of a one-row 0.5B call on a
CPU); the drafter reads log-probabilities over its draft vocabulary only (the K most frequent tokens plus every
context token), so it asks llama.cpp for the final norm's hidden states (``GGUFModel(hidden_states=True)``)
and multiplies them by those rows here, and only for the rows whose distribution it reads.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["VocabHead"]


class VocabHead:
    """The GGUF's output matrix (``output.weight``, else the tied ``token_embd.weight``), dequantized once to
    bfloat16 [vocab, n_embd]; :meth:`logits` multiplies hidden states by the rows of a vocabulary subset."""

    def __init__(self, path: str):
        import gguf

        tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
        if tensor is None:
            raise ValueError(f"{path} has neither output.weight nor token_embd.weight: no LM head to read")
        rows = gguf.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        self.weight = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(torch.bfloat16)
        self._ids: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # self.weight[self._ids]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """bfloat16 [len(ids), n_embd]: the head rows of ``ids`` (re-gathered only when the ids change)."""
        if ids is not self._ids and (self._ids is None or self._ids.shape != ids.shape or not torch.equal(self._ids, ids)):
            self._ids, self._rows = ids, self.weight[ids].contiguous()
        return self._rows

    def logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, len(ids)] of hidden states [rows, n_embd] over the tokens ``ids`` (bfloat16
        products with float32 sums; a row's last bits may depend on how many rows share the product: the
        logits only steer drafts)."""
        return (hidden.to(torch.bfloat16) @ self.rows(ids).T).float()
