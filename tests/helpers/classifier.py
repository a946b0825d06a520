"""A tiny random-weight reward model for tests: a LlamaForSequenceClassification with one output
(``num_labels = 1``) and SmolLM2's tokenizer (its chat template too), written to a folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from nodes.inference.models import ensure_smollm2_tokenizer


def tiny_classifier(dst: Path, seed: int = 0) -> Path:
    """Write the tiny reward model to ``dst`` (made if absent); returns ``dst``."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        num_labels=1,
    )
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config).to(torch.float32)  # type: ignore[arg-type]  # transformers types the wrapped .to() as taking the model
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dst))
    for f in ensure_smollm2_tokenizer().iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, dst / f.name)
    return dst
