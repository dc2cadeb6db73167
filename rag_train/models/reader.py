"""Fusion-in-Decoder reader (Izacard & Grave 2021) over `T5ForConditionalGeneration`.

Each (question, passage) pair is encoded independently by the T5 encoder ([B*P, L]); the encoder
states are concatenated per question to [B, P*L, d] and the decoder cross-attends to all of them.
`FiDReader` *is* a `T5ForConditionalGeneration` (a subclass adding no parameters), so its state dict,
`save_pretrained` / `from_pretrained` files and generation utilities are exactly those of plain T5:
Hugging Face T5 checkpoints load as they are, and a saved reader loads back as plain T5.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import T5ForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

from rag_train.config import ReaderConfig
from rag_train.io import verify_model_files
from rag_train.models.attention import eager_t5_attention_on_cpu


class ReaderLoadError(RuntimeError):
    """The configured reader cannot be built or loaded; the message says what to provide instead."""


def hub_offline() -> bool:
    """True when the Hugging Face Hub must not (offline env vars, read now) or cannot be reached."""
    from rag_train.data.tokenizer import hub_reachable

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    return not hub_reachable()


class FiDReader(T5ForConditionalGeneration):
    """T5 whose `forward` / `generate` also accept FiD inputs `input_ids[B, P, L]`.

    2-D inputs behave exactly as in plain T5 (that is the path `generate` uses internally).
    """

    def __init__(self, config):
        super().__init__(config)
        eager_t5_attention_on_cpu(self)  # built or loaded: every reader goes through here

    @classmethod
    def from_config(
        cls, cfg: ReaderConfig, tokenizer=None, dtype: Optional[torch.dtype] = None
    ) -> "FiDReader":
        """`tiny`: random init sized by `cfg.tiny` for `tokenizer`; otherwise a hub id or local path.

        Folders and the local cache are tried first; a model found in neither, with the hub offline or
        unreachable, fails at once with a message naming what to download instead of hanging.
        """
        if cfg.model == "tiny":
            model = cls._tiny(cfg, tokenizer, dtype)
        else:
            model = cls._pretrained(cfg.model, dtype)
            if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
                raise ReaderLoadError(
                    f"reader.model={cfg.model!r} has {model.config.vocab_size} token embeddings but the "
                    f"tokenizer has {len(tokenizer)} tokens: use the model's own tokenizer (reader.tokenizer)"
                )
        if cfg.gradient_checkpointing:
            model.enable_activation_checkpointing()
        return model

    @classmethod
    def _tiny(cls, cfg: ReaderConfig, tokenizer, dtype: Optional[torch.dtype]) -> "FiDReader":
        if tokenizer is None:
            if cfg.tokenizer is None:
                raise ReaderLoadError("reader.model='tiny' needs a tokenizer: pass one or set reader.tokenizer")
            from rag_train.data.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(cfg.tokenizer)
        from rag_train.models.tiny import tiny_t5_config

        model = cls(tiny_t5_config(tokenizer, cfg.tiny))
        return model.to(dtype) if dtype is not None else model

    @classmethod
    def _pretrained(cls, name_or_path: str, dtype: Optional[torch.dtype]) -> "FiDReader":
        if Path(name_or_path).is_dir():  # a saved reader: its files must match their checksums
            verify_model_files(name_or_path)
        try:  # the local folder or cache first: no network round trip when the weights are here
            return cls.from_pretrained(name_or_path, dtype=dtype, local_files_only=True)
        except OSError as exc:
            if Path(name_or_path).is_dir():
                raise ReaderLoadError(
                    f"reader.model={name_or_path!r} is a folder but not a T5 checkpoint (save_pretrained format): "
                    f"{str(exc).splitlines()[0]}"
                ) from exc
        if hub_offline():
            raise ReaderLoadError(
                f"reader.model={name_or_path!r}: not a local folder, not in the Hugging Face cache, and the hub is "
                f"offline / unreachable. Download it where the network is available (`huggingface-cli download "
                f"{name_or_path}`) or set reader.model to a local T5 folder (save_pretrained format)."
            )
        try:
            return cls.from_pretrained(name_or_path, dtype=dtype)
        except OSError as exc:
            raise ReaderLoadError(f"reader.model={name_or_path!r} could not be loaded from the hub: {exc}") from exc

    def enable_activation_checkpointing(self) -> None:
        """Recompute layer activations in backward (transformers >= 5 renamed the method)."""
        if hasattr(self, "activation_checkpointing_enable"):
            self.activation_checkpointing_enable()
        else:
            self.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # ------------------------------------------------------------------------------------------------
    # Encoding
    # ------------------------------------------------------------------------------------------------

    @staticmethod
    def _check_fid_shapes(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        if input_ids.dim() != 3:
            raise ValueError(f"FiD input_ids must be [batch, passages, length], got shape {tuple(input_ids.shape)}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )

    def encode_pairs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Encoder states of every (question, passage) pair on its own: [B*P, L, d]."""
        self._check_fid_shapes(input_ids, attention_mask)
        batch, passages, length = input_ids.shape
        out = self.encoder(
            input_ids=input_ids.reshape(batch * passages, length),
            attention_mask=attention_mask.reshape(batch * passages, length),
        )
        return out.last_hidden_state

    @staticmethod
    def fuse(encoder_states: torch.Tensor, attention_mask: torch.Tensor) -> tuple[BaseModelOutput, torch.Tensor]:
        """Concatenate per-passage states [B*P, L, d] into the decoder's memory [B, P*L, d] (+ mask [B, P*L])."""
        batch, passages, length = attention_mask.shape
        fused = encoder_states.reshape(batch, passages * length, encoder_states.shape[-1])
        return BaseModelOutput(last_hidden_state=fused), attention_mask.reshape(batch, passages * length)

    # ------------------------------------------------------------------------------------------------
    # Training / scoring
    # ------------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        encoder_outputs=None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        """FiD when `input_ids` is [B, P, L]: `.loss` is the answer NLL (labels [B, T], -100 = padding)
        given all P passages, `.logits` [B, T, V], `.encoder_last_hidden_state` the fused [B, P*L, d]
        (reshape to [B*P, L, d] for `passage_log_likelihoods`). 2-D inputs: plain T5."""
        if labels is not None:  # training or scoring: no decoding cache to fill
            kwargs.setdefault("use_cache", False)
        if input_ids is not None and input_ids.dim() == 3:
            if encoder_outputs is not None:
                raise ValueError("pass either FiD input_ids [B, P, L] or encoder_outputs, not both")
            states = self.encode_pairs(input_ids, attention_mask)
            encoder_outputs, attention_mask = self.fuse(states, attention_mask)
            input_ids = None
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            encoder_outputs=encoder_outputs,
            **kwargs,
        )

    def passage_log_likelihoods(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        encoder_states: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """log P(a | y_p, x) for each single passage: [B, P] sums of answer-token log-probs (fp32).

        Reuses the FiD encoder states (any tensor holding [B*P, L, d], e.g. the fused
        `forward(...).encoder_last_hidden_state`) instead of re-encoding: the decoder runs once over B*P
        rows, the labels repeated P times, each row cross-attending only to its own passage. It follows
        the caller's grad mode; wrap in `torch.no_grad()` when the result is a distillation target.
        """
        self._check_fid_shapes(input_ids, attention_mask)
        batch, passages, length = input_ids.shape
        if labels.dim() != 2 or labels.shape[0] != batch:
            raise ValueError(f"labels must be [batch={batch}, answer_length], got shape {tuple(labels.shape)}")
        if encoder_states is None:
            encoder_states = self.encode_pairs(input_ids, attention_mask)
        encoder_states = encoder_states.reshape(batch * passages, length, -1)
        row_labels = labels.repeat_interleave(passages, dim=0)
        out = super().forward(
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder_states),
            attention_mask=attention_mask.reshape(batch * passages, length),
            decoder_input_ids=self._shift_right(row_labels),
            use_cache=False,
        )
        token_nll = F.cross_entropy(
            out.logits.float().transpose(1, 2), row_labels, ignore_index=-100, reduction="none"
        )
        return -token_nll.sum(dim=1).view(batch, passages)

    @torch.no_grad()
    def generate(self, input_ids=None, attention_mask=None, max_new_tokens: Optional[int] = None, **kwargs):
        """Hugging Face `generate` (greedy / beam / sampling, all its options) over FiD inputs [B, P, L]."""
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        if input_ids is not None and input_ids.dim() == 3:
            states = self.encode_pairs(input_ids, attention_mask)
            encoder_outputs, fused_mask = self.fuse(states, attention_mask)
            return super().generate(encoder_outputs=encoder_outputs, attention_mask=fused_mask, **kwargs)
        return super().generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

