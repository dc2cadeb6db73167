"""Dual-encoder retriever f(x), g(y): two sentence-transformers towers (or one shared).

Each tower is a `SentenceTransformer` made of Transformer -> Pooling -> optional Dense -> optional
Normalize, so a trained retriever saves as ordinary sentence-transformers folders that any ST / FAISS
tooling can load, and GTR checkpoints (`sentence-transformers/gtr-t5-base`) load unchanged.
"""

from __future__ import annotations

import copy
import hashlib
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import nn

from rag_train.config import ConfigError, RetrieverConfig
from rag_train.io import atomic_directory, atomic_write_json, folder_checksums, read_json, state_bytes, verify_checksums
from rag_train.models.attention import use_encoder_kernel

SAVE_FORMAT_VERSION = 1
META_FILE = "dual_encoder.json"
Passage = Union[dict, str]


def format_passage(passage: Passage) -> str:
    """The one text a passage is encoded as (buffer build, training and eval must agree)."""
    if isinstance(passage, str):
        return passage
    title = (passage.get("title") or "").strip()
    text = passage.get("text") or ""
    return f"title: {title} | {text}" if title else text


def _st_modules():
    from sentence_transformers.sentence_transformer import modules

    return modules


def resolve_model_path(name_or_path: str) -> Path:
    """A local folder for `name_or_path`: itself, the HF cache's snapshot, or a download when online."""
    path = Path(name_or_path)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"retriever.model={name_or_path!r} is a file; give a model folder")
        return path
    if str(name_or_path).startswith(("/", "./", "../", "~")) or str(name_or_path).count("/") > 1:
        raise ConfigError(f"retriever.model={name_or_path!r}: no such local folder (and not a hub id 'org/name')")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:
        pass
    from rag_train.data.tokenizer import hub_reachable

    if not hub_reachable():
        raise ConfigError(
            f"retriever.model={name_or_path!r} is not a local folder, is not in the Hugging Face cache, and the hub "
            f"is unreachable (offline). Download it on a connected machine (e.g. `huggingface-cli download "
            f"{name_or_path} --local-dir DIR`) and set retriever.model=DIR, or use retriever.model=tiny."
        )
    return Path(snapshot_download(name_or_path))


def _tiny_encoder_folder(cfg: RetrieverConfig, tokenizer, seed: int, folder: Path) -> None:
    """Save a randomly initialised (seeded) T5 encoder + tokenizer so ST loads it like any checkpoint."""
    from transformers import T5EncoderModel

    from rag_train.models.tiny import tiny_t5_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = T5EncoderModel(tiny_t5_config(tokenizer, cfg.tiny))
    # not `encoder.save_pretrained`: under torch.distributed it writes on rank 0 only, and every rank
    # builds its own temporary folder
    from safetensors.torch import save_model

    encoder.config.save_pretrained(str(folder))
    save_model(encoder, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(str(folder))


def _build_tower(cfg: RetrieverConfig, tokenizer=None, seed: int = 0):
    """One SentenceTransformer tower as described by `cfg`."""
    from sentence_transformers import SentenceTransformer

    modules = _st_modules()
    if cfg.model == "tiny":
        if tokenizer is None and cfg.tokenizer is None:
            raise ConfigError("retriever.model=tiny needs a tokenizer: pass one or set retriever.tokenizer")
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            from rag_train.data.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer or cfg.tokenizer)
        with tempfile.TemporaryDirectory(prefix="tiny-retriever-") as tmp:
            _tiny_encoder_folder(cfg, tokenizer, seed, Path(tmp))
            transformer = modules.Transformer(tmp)
    else:
        folder = resolve_model_path(cfg.model)
        if (folder / "modules.json").is_file():
            if cfg.tokenizer is not None:
                raise ConfigError(
                    f"retriever.tokenizer={cfg.tokenizer!r} cannot override the tokenizer of the "
                    f"sentence-transformers folder {folder}; leave it unset"
                )
            tower = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
            if cfg.normalize and not isinstance(tower[len(tower) - 1], modules.Normalize):
                tower.append(modules.Normalize())
            return tower
        extra = {"tokenizer_name_or_path": str(resolve_model_path(cfg.tokenizer))} if cfg.tokenizer else {}
        transformer = modules.Transformer(str(folder), **extra)
    width = transformer.get_embedding_dimension()
    stack = [transformer, modules.Pooling(width, pooling_mode=cfg.pooling)]
    if cfg.projection_dim is not None:
        stack.append(modules.Dense(width, cfg.projection_dim, bias=False, activation_function=nn.Identity()))
    if cfg.normalize:
        stack.append(modules.Normalize())
    return SentenceTransformer(modules=stack, device="cpu")


class DualEncoder(nn.Module):
    """f(x) = query tower, g(y) = passage tower; scores are inner products of their outputs."""

    def __init__(self, query_tower, passage_tower=None, max_query_length: int = 32, max_passage_length: int = 128,
                 train_passage_encoder: bool = True, encoder_kernel: str = "auto"):
        super().__init__()
        self.query_encoder = query_tower
        self.passage_encoder = passage_tower if passage_tower is not None else query_tower
        self.max_query_length = max_query_length
        self.max_passage_length = max_passage_length
        self.train_passage_encoder = train_passage_encoder
        if not self.shared_towers:
            query_tower.max_seq_length = max_query_length
            passage_tower.max_seq_length = max_passage_length
            passage_tower.requires_grad_(train_passage_encoder)
        if self.query_encoder.get_embedding_dimension() != self.passage_encoder.get_embedding_dimension():
            raise ValueError("query and passage towers give vectors of different sizes")
        self.encoder_kernel = encoder_kernel  # retriever.encoder_kernel; `embed_rows` reads it for the corpus pass
        use_encoder_kernel(self, encoder_kernel)

    @property
    def shared_towers(self) -> bool:
        return self.query_encoder is self.passage_encoder

    @property
    def dim(self) -> int:
        return int(self.query_encoder.get_embedding_dimension())

    @classmethod
    def from_config(cls, cfg: RetrieverConfig, tokenizer=None, seed: int = 0) -> "DualEncoder":
        """Build from config; separate towers start as copies (like GTR's f and g from one checkpoint).

        `retriever.model` may also name a folder written by `save` (a trained retriever's `retriever/`):
        both towers are loaded as saved (their own tokenizer, pooling and projection), with the config's
        lengths and `train_passage_encoder`; this is how a run starts from a retrieval-pretrained model."""
        if cfg.model != "tiny" and (Path(cfg.model) / META_FILE).is_file():
            saved = cls.load(cfg.model)
            if saved.shared_towers != cfg.shared_towers:
                raise ConfigError(f"retriever.model={cfg.model!r} was saved with shared_towers={saved.shared_towers}; "
                                  f"set retriever.shared_towers={str(saved.shared_towers).lower()}")
            if cfg.tokenizer is not None:
                raise ConfigError(f"retriever.tokenizer={cfg.tokenizer!r} cannot override the tokenizer of the saved "
                                  f"retriever {cfg.model}; leave it unset")
            return cls(saved.query_encoder, None if saved.shared_towers else saved.passage_encoder,
                       cfg.max_query_length, cfg.max_passage_length, cfg.train_passage_encoder,
                       cfg.encoder_kernel).train()
        query_tower = _build_tower(cfg, tokenizer, seed)
        passage_tower = None if cfg.shared_towers else copy.deepcopy(query_tower)
        return cls(query_tower, passage_tower, cfg.max_query_length, cfg.max_passage_length, cfg.train_passage_encoder,
                   cfg.encoder_kernel)

    def _encode(self, tower, texts: Sequence[str], max_length: int) -> torch.Tensor:
        if len(texts) == 0:
            raise ValueError("nothing to encode: empty list of texts")
        features = tower.preprocess(list(texts), max_length=max_length)
        device = next(tower.parameters()).device
        features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
        return tower(features)["sentence_embedding"]

    def encode_queries(self, texts: Sequence[str]) -> torch.Tensor:
        """f(x) for raw question strings: [B, D], differentiable unless under no_grad / inference_mode."""
        return self._encode(self.query_encoder, texts, self.max_query_length)

    def encode_passages(self, passages: Sequence[Passage]) -> torch.Tensor:
        """g(y) for passage dicts {title, text} (or preformatted strings): [B, D]."""
        texts = [format_passage(p) for p in passages]
        if self.train_passage_encoder:
            return self._encode(self.passage_encoder, texts, self.max_passage_length)
        with torch.no_grad():
            return self._encode(self.passage_encoder, texts, self.max_passage_length)

    def encode_passage_features(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """g(y) for passages already tokenised (input_ids, attention_mask, ... on the tower's device): the
        forward of `encode_passages` without its tokenisation (buffer.embed tokenises in worker processes)."""
        return self.passage_encoder(dict(features, modality="text"))["sentence_embedding"]

    def forward(self, queries: Sequence[str], passages: Sequence[Passage]) -> tuple[torch.Tensor, torch.Tensor]:
        """(f(x) [B, D], g(y) [P, D]) in ONE call, so that a DDP-wrapped encoder sees one forward per step."""
        return self.encode_queries(queries), self.encode_passages(passages)

    def fingerprint(self, tower: Optional[str] = None) -> str:
        """sha256 over parameter names, shapes, dtypes and bytes: the whole model, or tower='query'/'passage'."""
        modules = {None: self, "query": self.query_encoder, "passage": self.passage_encoder}
        if tower not in modules:
            raise ValueError(f"tower={tower!r}: expected None, 'query' or 'passage'")
        digest = hashlib.sha256()
        for name, param in modules[tower].named_parameters():
            tensor = param.detach().to("cpu").contiguous()
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def save(self, directory: Union[str, Path]) -> None:
        """Write `query/` + `passage/` (or `shared/`) sentence-transformers folders and dual_encoder.json.

        Written into a temporary sibling and swapped in, so an existing save is never half-overwritten; a full
        disk or a read-only folder raises StorageError naming `directory` and the space the save needs.
        """
        needed = state_bytes(self.query_encoder, None if self.shared_towers else self.passage_encoder) + 2**20
        with atomic_directory(directory, "saving the retriever to", needed=needed) as tmp:
            towers = {"shared": self.query_encoder} if self.shared_towers else {
                "query": self.query_encoder, "passage": self.passage_encoder}
            for name, tower in towers.items():  # no generic model card: `export` writes the retriever's own
                tower.save(str(tmp / name), create_model_card=False)
            atomic_write_json(tmp / META_FILE, {
                "format_version": SAVE_FORMAT_VERSION,
                "shared_towers": self.shared_towers,
                "max_query_length": self.max_query_length,
                "max_passage_length": self.max_passage_length,
                "train_passage_encoder": self.train_passage_encoder,
                "fingerprint": self.fingerprint(),
                "files": folder_checksums(tmp),  # sha256 + size of every tower file, checked by `load`
            })

    @classmethod
    def load(cls, directory: Union[str, Path]) -> "DualEncoder":
        """Restore a model written by `save` (weights and lengths; byte-identical parameters), in eval mode:
        encoding with it is deterministic (no dropout) until a trainer calls `.train()`."""
        from sentence_transformers import SentenceTransformer

        directory = Path(directory)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path}: missing; {directory} is not a saved DualEncoder")
        meta = read_json(meta_path)
        if meta.get("format_version") != SAVE_FORMAT_VERSION:
            raise ValueError(f"{meta_path}: field 'format_version': {meta.get('format_version')!r} is not supported")
        if "files" in meta:  # CorruptFileError naming a truncated or altered weight / config file
            verify_checksums(directory, meta["files"], meta_path)

        def tower(name: str):
            return SentenceTransformer(str(directory / name), device="cpu", local_files_only=True)

        if meta["shared_towers"]:
            towers = (tower("shared"), None)
        else:
            towers = (tower("query"), tower("passage"))
        return cls(*towers, meta["max_query_length"], meta["max_passage_length"], meta["train_passage_encoder"]).eval()
