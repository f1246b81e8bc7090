"""Export a trained decoder as a Hugging Face checkpoint of its family (safetensors, no pickle).

Each family is architecturally its Hugging Face model, so its weights map one to one (``model.hf``'s tables):
gpt2 (pre-LN, learned positions, exact GELU, tied head) onto ``GPT2LMHeadModel``, llama (RMSNorm, rotate-half
rotary positions, SwiGLU, grouped-query attention) onto ``LlamaForCausalLM``, or onto ``Qwen3ForCausalLM`` with
``model.qk_norm`` (Qwen3 is that Llama with an RMSNorm over each head's query and key). Anyone can then load the result
with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and ``AutoTokenizer.from_pretrained(out_dir)``
without this package.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
from safetensors.torch import save_file
from tokenizers import Tokenizer

from callbacks import owned_folders
from runfab import created_files
from model import hf
from model.hf import WEIGHTS_NAME
from model.decoder import Decoder, ModelConfig
from model.llama import Llama

log = logging.getLogger(__name__)

HF_NAMES = {"gpt2": "GPT-2", "llama": "Llama", "qwen3": "Qwen3"}
# safetensors and tokenizers write in Rust and raise a plain error whose text carries the OS error's number.
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class ExportFailed(RuntimeError):
    """The trained model could not be written (a full or read-only output filesystem); nothing was exported."""


def as_os_error(error: BaseException) -> OSError | None:
    """The OS error behind a failed write: ``error`` itself, or the one a library's wrapper names; None
    for anything else (a bug stays a traceback)."""
    if isinstance(error, OSError):
        return error
    found = RUST_OS_ERROR.search(str(error)) if isinstance(error, Exception) else None
    if found is None:
        return None
    code = int(found[1])
    return OSError(code, os.strerror(code) if code in errno.errorcode else str(error))


def gpt2_config(config: ModelConfig, eos_id: int):
    """A GPT2Config that computes exactly what our GPT computes (exact GELU, no dropout)."""
    from transformers import GPT2Config  # heavy import, only paid when exporting

    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_seq_len,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_inner=4 * config.n_embd,
        # "gelu" is erf-based like F.gelu; GPT-2's default "gelu_new" is the tanh approximation.
        activation_function="gelu",
        layer_norm_epsilon=config.layer_norm_eps,
        initializer_range=config.init_std,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,  # the tokenizer's and generation_config.json's pad token too
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
        dtype="float32",
    )


def llama_config(config: ModelConfig, eos_id: int):
    """A LlamaConfig that computes exactly what our Llama computes (no biases, no dropout, default rotary); a
    Qwen3Config, every layer full attention, for one with ``qk_norm``."""
    from transformers import LlamaConfig, Qwen3Config  # heavy import, only paid when exporting

    if config.qk_norm:
        return Qwen3Config(**llama_settings(config, eos_id), use_sliding_window=False, sliding_window=None,
                           max_window_layers=config.n_layer, layer_types=["full_attention"] * config.n_layer,
                           architectures=["Qwen3ForCausalLM"])
    return LlamaConfig(**llama_settings(config, eos_id), mlp_bias=False, architectures=["LlamaForCausalLM"])


def llama_settings(config: ModelConfig, eos_id: int) -> dict:
    """What LlamaConfig and Qwen3Config name alike."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.mlp_width,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        initializer_range=config.init_std,
        rms_norm_eps=config.layer_norm_eps,
        rope_theta=config.rope_theta,
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,  # the tokenizer's and generation_config.json's pad token too
        tie_word_embeddings=config.tie_embeddings,
        dtype="float32",
    )


def hf_config(model: Decoder, eos_id: int):
    """The Hugging Face config of ``model``'s family that computes what it computes."""
    return llama_config(model.config, eos_id) if isinstance(model, Llama) else gpt2_config(model.config, eos_id)


def _write_export(model: Decoder, tokenizer_path: Path, folder: Path, eos_token: str) -> None:
    """Write every file of the checkpoint into ``folder`` (which must exist)."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"{tokenizer_path} has no token {eos_token!r}")
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's "
            f"vocab_size {model.config.vocab_size}"
        )

    save_file(hf.to_hf(model), str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    hf_config(model, eos_id).save_pretrained(folder)
    if isinstance(model, Llama):
        _name_rope_theta_for_4x(folder / "config.json", model.config.rope_theta)
    # Without a pad id, generate() warns and guesses one; GPT-2's convention, kept for both families, pads with EOS.
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(folder)
    # Byte-level BPE has no unknown token; GPT-2 uses EOS for bos/unk too.
    PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_path),
        eos_token=eos_token,
        bos_token=eos_token,
        unk_token=eos_token,
        pad_token=eos_token,  # so that tokenizer(texts, padding=True) works; the model masks padding out
        model_max_length=model.config.max_seq_len,
    ).save_pretrained(folder)
    _name_portable_tokenizer_class(folder / "tokenizer_config.json")


def _name_rope_theta_for_4x(path: Path, theta: float) -> None:
    """Write the rotary base also as ``rope_theta``, the key transformers 4.x reads; 5.x writes only
    ``rope_parameters`` (and reads either), so a 4.x reader would otherwise turn by its default base."""
    settings = json.loads(path.read_text())
    settings["rope_theta"] = theta
    created_files.write_text(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")


def _name_portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class as transformers 4.x knows it too; 5.x maps it to the same class.

    transformers 5 writes ``TokenizersBackend``, which 4.x cannot resolve, so readers pinned
    to 4.x (evaluation harnesses often are) would fail to load the tokenizer.
    """
    settings = json.loads(path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    created_files.write_text(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")


def export_model(
    model: Decoder, tokenizer_path: str | Path, out_dir: str | Path, eos_token: str = "<|endoftext|>",
    prepare: Callable[[Path], None] = lambda staging: None, complete: Callable[[Path], None] = lambda staging: None,
) -> list[Path]:
    """Write a Hugging Face checkpoint of ``model`` (its family's) plus its tokenizer to ``out_dir``; return its files.

    Everything is written into a temporary sibling folder first and then renamed into place,
    so a crash mid-export leaves either the previous export or none, never half a model; one
    killed while writing leaves that folder (``unfinished_exports``), one killed while swapping the
    folders leaves the previous export aside (``displaced_exports``). ``prepare(staging)`` runs
    on the empty staging folder first, ``complete(staging)`` after the model's files, to add what
    must be published with them (the run record). A write that fails for the filesystem's
    reason (full, read-only) raises an OSError, whichever library wrote.
    """
    tokenizer_path, out_dir = Path(tokenizer_path), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        prepare(staging)
        _write_export(model, tokenizer_path, staging, eos_token)
        complete(staging)
        # mkdtemp (and safetensors) create owner-only entries; an export is meant to be shared.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            # Move the old export aside first: rename cannot replace a non-empty folder.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / out_dir.name)
            staging.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(out_dir)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        written = as_os_error(error)
        if written is None or written is error:
            raise
        raise written from error
    return sorted(p for p in out_dir.iterdir() if p.is_file())


def unfinished_exports(out_dir: Path) -> list[Path]:
    """The staging folders of exports to ``out_dir`` that never finished: the process was killed while writing."""
    return sorted(p for p in out_dir.parent.glob(f".{out_dir.name}.tmp-*") if p.is_dir() and not p.is_symlink())


def displaced_exports(out_dir: Path) -> list[Path]:
    """The folders an export moved the previous ``out_dir`` into before renaming the new one into place
    (``.NAME.old-*``, holding ``NAME``): one stays when the process was killed between the two renames."""
    return sorted(p for p in out_dir.parent.glob(f".{out_dir.name}.old-*") if p.is_dir() and not p.is_symlink())


class ExportModel(pl.Callback):
    """At the end of training, export ``pl_module.model`` as a Hugging Face folder of its family.

    Only global rank 0 writes. The weights are read directly, so this suits single-device and
    DDP runs; a sharded (FSDP) model would need its parameters gathered on every rank first.
    """

    def __init__(self, out_dir: str | Path, tokenizer_path: str | Path,
                 published_with: Callable[[pl.Trainer, pl.LightningModule, Path], None] | None = None) -> None:
        """``published_with(trainer, pl_module, staging)`` writes what belongs with the model (the run
        record) into its staging folder: the model's files and those appear together or not at all."""
        super().__init__()
        self.out_dir = Path(out_dir)
        self.tokenizer_path = Path(tokenizer_path)
        self.published_with = published_with

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        if trainer.global_step == 0:  # stopped before the first update: an untrained model is no result
            log.warning("nothing was trained, so no model is exported to %s", self.out_dir)
            return
        complete = ((lambda staging: self.published_with(trainer, pl_module, staging)) if self.published_with
                    else (lambda staging: None))
        try:
            export_model(pl_module.model, self.tokenizer_path, self.out_dir, prepare=owned_folders.mark,
                         complete=complete)
        except OSError as error:  # after all the training: one line that says what happened, no traceback
            where = f" ({error.filename})" if error.filename else ""
            raise ExportFailed(
                f"writing the model to {self.out_dir} failed after {trainer.global_step} optimizer steps: "
                f"{error.strerror or error}{where}; nothing was exported. Give the output root room and write "
                "access (RUNFABRIC_OUTPUT or output.root), then train again") from error
        config = pl_module.model.config
        name = HF_NAMES["qwen3" if config.family == "llama" and config.qk_norm else config.family]
        log.info("exported Hugging Face %s model to %s", name, self.out_dir)
