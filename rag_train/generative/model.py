"""The generator: T5 with an optional Np Decoding head (seed 003).

Without a CE table it is plain `T5ForConditionalGeneration` (vanilla decoding over the vocabulary). With one
(`set_ce`), output ids are CE rows: logits_t = s * h_t . CE^T, with h_t the decoder's output and s the
same d_model**-0.5 scale T5 applies before its tied vocabulary head (so a CE equal to the vocabulary
embeddings gives exactly the vanilla logits); labels are CE row ids, the CE is a frozen buffer, never a
parameter. The decoder's INPUT for a previous row is the model's own embedding of that row's token
(`decoder_inputs="vocab"`, default) or the CE row itself (`"ce"`); see docs/generative_retrieval.md.
Weights save and load as plain T5; the CE lives in its own stored table.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import T5ForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

from rag_train.generative.ce_table import START_ROW
from rag_train.io import verify_model_files
from rag_train.models.attention import eager_t5_attention_on_cpu
from rag_train.models.reader import ReaderLoadError, hub_offline

# the decoding cache's name in model outputs: `cache` in transformers 5, `past_key_values` before
CACHE = "cache" if "cache" in {spec.name for spec in dataclasses.fields(Seq2SeqLMOutput)} else "past_key_values"


class GenerativeT5(T5ForConditionalGeneration):
    """T5 whose output vocabulary is the CE table when one is set, the T5 vocabulary otherwise."""

    def __init__(self, config):
        super().__init__(config)
        eager_t5_attention_on_cpu(self)  # built or loaded: every generator goes through here
        self.register_buffer("ce", None, persistent=False)
        self.register_buffer("row_token", None, persistent=False)
        self.ce_decoder_inputs = False

    def set_ce(self, vectors: torch.Tensor, row_token: torch.Tensor, decoder_inputs: str = "vocab") -> None:
        """Use `vectors` [R, d] as the frozen output vocabulary (row r stands for token row_token[r])."""
        if vectors.shape[1] != self.config.d_model or len(row_token) != len(vectors):
            raise ValueError(f"CE of shape {tuple(vectors.shape)} with {len(row_token)} tokens does not fit d_model "
                             f"{self.config.d_model}")
        device = self.shared.weight.device
        self.ce = vectors.detach().to(device, self.shared.weight.dtype)
        self.row_token = row_token.to(device, torch.long)
        self.ce_decoder_inputs = decoder_inputs == "ce"

    @property
    def np_decoding(self) -> bool:
        return self.ce is not None

    def row_embeddings(self, rows: torch.Tensor) -> torch.Tensor:
        """Decoder input embeddings of previous output rows (the start row is always the pad embedding)."""
        vocab = self.shared(self.row_token[rows])
        if not self.ce_decoder_inputs:
            return vocab
        return torch.where((rows == START_ROW).unsqueeze(-1), vocab, self.ce[rows])

    def output_states(self, decoder_states: torch.Tensor) -> torch.Tensor:
        """The vectors dotted with the output vocabulary (T5's tied-head scaling included)."""
        if self.config.scale_decoder_outputs:
            return decoder_states * (self.model_dim**-0.5)
        return decoder_states

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, labels=None, use_cache=None, **kwargs) -> Seq2SeqLMOutput:
        """T5's forward; with Np Decoding, logits over the CE table. The decoding cache is passed through in
        `kwargs` under the name the installed transformers uses (`cache` in 5.x, `past_key_values` before), never
        named here: naming one of them makes transformers warn about the deprecated name or about both."""
        if not self.np_decoding:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                   decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_attention_mask,
                                   encoder_outputs=encoder_outputs, labels=labels, use_cache=use_cache, **kwargs)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs[0])
        if labels is not None and decoder_input_ids is None:
            decoder_input_ids = self._shift_right(labels)
        decoded = self.decoder(inputs_embeds=self.row_embeddings(decoder_input_ids),
                               attention_mask=decoder_attention_mask,
                               encoder_hidden_states=encoder_outputs.last_hidden_state,
                               encoder_attention_mask=attention_mask, use_cache=use_cache, **kwargs)
        logits = self.output_states(decoded.last_hidden_state) @ self.ce.T
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return Seq2SeqLMOutput(loss=loss, logits=logits, encoder_last_hidden_state=encoder_outputs.last_hidden_state,
                               **{CACHE: getattr(decoded, CACHE)})

    def first_output_state(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, d] the first decoder output embedding (decoder start only), scaled as for logits: CONTRA's query."""
        encoded = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        start = torch.full((len(input_ids), 1), START_ROW, dtype=torch.long, device=input_ids.device)
        embeds = self.row_embeddings(start) if self.np_decoding else self.shared(start)
        decoded = self.decoder(inputs_embeds=embeds, encoder_hidden_states=encoded,
                               encoder_attention_mask=attention_mask, use_cache=False)
        return self.output_states(decoded.last_hidden_state[:, 0])


def token_contrastive_loss(queries: torch.Tensor, rows: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """CONTRA's Eq. 2, mean over queries: -log( sum_{t+} e^<q,t+> / sum_{all rows} e^<q,t> ) =
    logsumexp over all rows - logsumexp over the positive rows. `positives` [B, R] bool, >= 1 per query."""
    if not bool(positives.any(dim=1).all()):
        raise ValueError("every query needs at least one positive row")
    scores = queries @ rows.T
    positive_scores = scores.masked_fill(~positives, float("-inf"))
    return (torch.logsumexp(scores, dim=1) - torch.logsumexp(positive_scores, dim=1)).mean()


def load_generator(model: str, tokenizer, tiny=None, dtype: Optional[torch.dtype] = None) -> GenerativeT5:
    """`tiny`: a random T5 shaped by `tiny` for `tokenizer`; otherwise a T5 checkpoint from a folder, the local
    cache or the hub. Offline and not local: ReaderLoadError at once, naming what to download."""
    if model == "tiny":
        from rag_train.models.tiny import tiny_t5_config

        generator = GenerativeT5(tiny_t5_config(tokenizer, tiny))
        return generator.to(dtype) if dtype is not None else generator
    if Path(model).is_dir():  # a saved generator: its files must match their checksums
        verify_model_files(model)
    try:
        return GenerativeT5.from_pretrained(model, dtype=dtype, local_files_only=True)
    except OSError as exc:
        if Path(model).is_dir():
            raise ReaderLoadError(f"generator.model={model!r} is a folder but not a T5 checkpoint: "
                                  f"{str(exc).splitlines()[0]}") from exc
    if hub_offline():
        raise ReaderLoadError(
            f"generator.model={model!r}: not a local folder, not in the Hugging Face cache, and the hub is offline / "
            f"unreachable. Download it where the network is available (`huggingface-cli download {model}`) or set "
            "generator.model to a local T5 folder (save_pretrained format).")
    return GenerativeT5.from_pretrained(model, dtype=dtype)
