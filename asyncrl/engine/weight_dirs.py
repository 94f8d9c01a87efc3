"""The weight directories servers load: ``write_weights_dir`` writes the format every
server loads with ``/update_weights_from_disk`` (and vLLM's ``reload_weights``): a Hugging
Face directory (safetensors, config, generation config, tokenizer), written under a
temporary name and renamed into place, so a server never reads half a version; a tied
weight is written under its second name too (``TIED_FILE``). ``read_weights_dir`` reads
its tensors back (the embedded engine and its server)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from asyncrl.models import ModelConfig, hf_config, load_tokenizer, model_class


def write_weights_dir(state: Mapping[str, torch.Tensor], model_path: str, out_dir: Path) -> Path:
    """Write ``state`` as a Hugging Face directory servers load (safetensors weights, and the
    config, generation config and tokenizer of ``model_path``); atomic: written under a
    temporary name, then renamed."""
    src, out_dir = Path(model_path), Path(out_dir)
    model_cfg = ModelConfig(path=model_path)
    with torch.device("meta"):
        plain = model_class(model_cfg).from_config(hf_config(model_cfg))
    # A tied model's state has its shared weight once (the trainer reads parameters, and
    # named_parameters names a tied one once): the LM head is that embedding.
    missing, unexpected = plain.load_state_dict(dict(state), strict=False, assign=True)
    if plain.config.tie_word_embeddings:
        plain.tie_weights()
    shared = {n for n, _ in plain.named_parameters(remove_duplicate=False)}
    shared -= {n for n, _ in plain.named_parameters()}
    missing = [name for name in missing if name not in shared]
    if missing or unexpected:
        raise ValueError(
            f"weights for {model_path} do not fit its config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    _name_tied_weights(plain, shared, tmp)
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", tmp / "generation_config.json")
    load_tokenizer(src).save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


TIED_FILE = "tied.safetensors"
"""Where ``write_weights_dir`` puts a tied weight under its second name (the LM head)."""


def _name_tied_weights(model: torch.nn.Module, names: set[str], out_dir: Path) -> None:
    """Write each tied weight under its second name as well (``lm_head.weight``), in
    ``TIED_FILE`` and the index of a sharded checkpoint. transformers leaves it out and
    ties the two again on load; vLLM's ``reload_weights`` (0.32) refills the input
    embedding in place but leaves the LM head tied to it on the old weights unless the
    checkpoint names the head: its samples would come from a head one version behind."""
    if not names:
        return
    tensors = {name: model.get_parameter(name).detach().contiguous() for name in sorted(names)}
    save_file(tensors, str(out_dir / TIED_FILE), metadata={"format": "pt"})
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, TIED_FILE))
        index.write_text(json.dumps(data, indent=2))


def read_weights_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in an HF model directory, on the CPU."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(path)!r}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state
