"""Realistic chat tokenizers, trained offline: Qwen-style and Llama-3-style byte-level BPE.

``FAMILIES`` writes down each family's pre-tokenizer regex, special tokens (in the real
order), BOS rule, stop tokens and chat template (our own Jinja, in the real turn
layout). ``build_bpe_tokenizer`` trains one with the ``tokenizers`` library on text that
reasoning-gym generates (``tokenizer_corpus``); the result renders
``apply_chat_template`` and survives ``save_tokenizer`` / ``load_tokenizer``.

Used by ``asyncrl.random_models`` (real-shape models) and by tests: ``small_tokenizer(family)``
gives a quick Qwen- or Llama-style tokenizer.

Special ids: a vocabulary trained here (tens of thousands of tokens) cannot reach the
real ids (Qwen 151643, Llama-3 128000), so the specials come right after the trained
tokens, in the real order with the real gaps; a model built for the tokenizer takes
its ids from it.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from asyncrl.models import load_tokenizer

Family = Literal["qwen", "llama"]


@dataclass(frozen=True)
class TokenizerFamily:
    """How one family's tokenizer splits text, marks turns and ends generation."""

    name: Family
    """``qwen`` or ``llama``."""
    special_tokens: tuple[str, ...]
    """Special tokens in id order, starting right after the trained vocabulary (where the
    real tokenizer starts them at ``real_first_special_id``)."""
    real_first_special_id: int
    """Id of ``special_tokens[0]`` in the real tokenizer (for reference and the report)."""
    bos_token: str | None
    """Prepended by ``tokenizer(text)`` with add_special_tokens=True; None: nothing is."""
    config_bos_token: str
    """What the model config names its BOS (Qwen names one that its tokenizer never adds)."""
    eos_token: str
    """The tokenizer's EOS: the end of an assistant turn, where a completion stops."""
    pad_token: str
    """Padding; never ``eos_token``, so masking padding cannot mask the end of a turn.
    (Qwen's pad, <|endoftext|>, is still one of its ``stop_tokens``, as in the real one.)"""
    stop_tokens: tuple[str, ...]
    """generation_config.eos_token_id: every token that ends generation."""
    split_pattern: str
    """Regex that cuts text into words before BPE (merges never cross its pieces)."""
    nfc: bool
    """NFC-normalise text first (Qwen2 does, Llama-3 does not)."""
    chat_template: str
    """Jinja chat template, rendered by transformers' ``apply_chat_template``."""


# The two pre-tokenizer regexes differ on digits: Qwen splits every digit apart, Llama-3
# keeps runs of up to three, which matters for arithmetic tasks.
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
"""System turn Qwen2.5's template writes when the conversation brings none."""

# Qwen2.5's turn layout: <|im_start|>{role}\n{content}<|im_end|>\n, a default system turn.
_QWEN_TEMPLATE = (
    "{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for turn in messages -%}"
    "{{- '<|im_start|>' + turn['role'] + '\\n' + turn['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Llama-3's layout: BOS once, then <|start_header_id|>{role}<|end_header_id|>\n\n
# {content, trimmed}<|eot_id|> per turn. Llama-3.2's own template also writes a dated
# system preamble ("Cutting Knowledge Date: ..."); it is left out here.
_LLAMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for turn in messages -%}"
    "{{- '<|start_header_id|>' + turn['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{{- (turn['content'] | trim) + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

FAMILIES: dict[str, TokenizerFamily] = {
    "qwen": TokenizerFamily(
        name="qwen",
        # Real ids 151643, 151644, 151645; Qwen2.5's later specials (tool calls, FIM,
        # vision) and Qwen3's <think> are not included.
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        real_first_special_id=151643,
        bos_token=None,
        config_bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        split_pattern=_WORDS + r"\p{N}" + _REST,
        nfc=True,
        chat_template=_QWEN_TEMPLATE,
    ),
    "llama": TokenizerFamily(
        name="llama",
        # Real ids 128000 … 128010 (Llama-3.1/3.2 names); the real tokenizer goes on with
        # reserved tokens up to 128255.
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>",
            "<|reserved_special_token_2|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        real_first_special_id=128000,
        bos_token="<|begin_of_text|>",
        config_bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        # The real Llama-3.2 tokenizer names no pad token; Meta's own recipes pad with
        # <|finetune_right_pad_id|>, which also keeps pad apart from every stop token.
        pad_token="<|finetune_right_pad_id|>",
        stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        split_pattern=_WORDS + r"\p{N}{1,3}" + _REST,
        nfc=False,
        chat_template=_LLAMA_TEMPLATE,
    ),
}


# Tasks whose generated questions and answers make the tokenizer corpus, with the entries
# each gives per round: word problems with worked solutions (the most), arithmetic, and
# word-list tasks for a wider English vocabulary. Tasks that emit junk byte runs
# (emoji_mystery's hidden selectors) or reversed words are left out; needle_haystack's
# entries are long, so it gives few.
CORPUS_TASKS: dict[str, int] = {
    "gsm_symbolic": 400,
    "basic_arithmetic": 200,
    "chain_sum": 200,
    "group_anagrams": 200,
    "needle_haystack": 40,
    "word_sorting": 200,
    "sentence_reordering": 200,
    "word_sequence_reversal": 200,
    "family_relationships": 100,
    "syllogism": 100,
    "letter_counting": 200,
    "calendar_arithmetic": 200,
    "knights_knaves": 100,
}


def _entry_texts(entry: dict[str, Any], index: int) -> list[str]:
    """A reasoning-gym entry as corpus text: question and (worked) answer, and every
    other entry again as a chat, so role names and turn breaks get their own tokens."""
    answer = entry["metadata"].get("answer_cot") or str(entry["answer"])
    texts = [f"{entry['question']}\n{answer}\n"]
    if index % 2 == 0:
        texts.append(f"user\n\n{entry['question']}\n\nassistant\n\n{answer}\n\n")
    return texts


def tokenizer_corpus(target_chars: int = 4_000_000, seed: int = 0) -> list[str]:
    """At least ``target_chars`` characters of reasoning-gym text (generated, not copied),
    in rounds over ``CORPUS_TASKS``; the same seed gives the same corpus. 4 MB: ~3 s."""
    import reasoning_gym  # imported here: only corpus building needs it

    texts: list[str] = []
    total, round_index = 0, 0
    while total < target_chars:
        for name, entries in CORPUS_TASKS.items():
            data = reasoning_gym.create_dataset(name, size=entries, seed=seed + round_index)
            for i, entry in enumerate(data):
                for text in _entry_texts(entry, i):
                    texts.append(text)
                    total += len(text)
        round_index += 1
    return texts


def _backend(spec: TokenizerFamily) -> Tokenizer:
    """An untrained byte-level BPE with the family's normaliser and pre-tokenizer."""
    backend = Tokenizer(models.BPE())
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(spec.split_pattern), behavior="isolated")
    # The regex does the word splitting; ByteLevel only maps bytes to printable symbols.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    backend.decoder = decoders.ByteLevel()
    return backend


def _post_processor(spec: TokenizerFamily, ids: dict[str, int]) -> processors.PostProcessor:
    """ByteLevel offsets, and for a BOS family the BOS in front of every encoded text."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    if spec.bos_token is None:
        return byte_level
    bos = spec.bos_token
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, ids[bos])],
    )
    return processors.Sequence([byte_level, template])


def build_bpe_tokenizer(
    family: Family, texts: Iterable[str], vocab_size: int
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``texts`` with ``family``'s specials and chat template.

    ``vocab_size`` bounds the trained tokens (256 bytes plus merges; fewer when the corpus
    runs out of pairs seen twice); the special tokens follow them, so ``len(tokenizer)`` is
    the trained size plus ``len(FAMILIES[family].special_tokens)``.
    """
    spec = FAMILIES[family]
    backend = _backend(spec)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    first_special = backend.get_vocab_size()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in spec.special_tokens]
    )
    ids = {t: backend.token_to_id(t) for t in spec.special_tokens}
    expected = {t: first_special + i for i, t in enumerate(spec.special_tokens)}
    if ids != expected:
        raise RuntimeError(f"special tokens landed at {ids}, expected {expected}")
    backend.post_processor = _post_processor(spec, ids)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        chat_template=spec.chat_template,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """``save_pretrained``, naming the class PreTrainedTokenizerFast (as Llama-3 does):
    transformers 5 writes TokenizersBackend, which transformers 4 (an engine's pin, say)
    cannot resolve; both load the generic name from tokenizer.json alike."""
    tokenizer.save_pretrained(out_dir)
    path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


@functools.cache
def _small_tokenizer_dir(family: Family, vocab_size: int) -> Path:
    """Trained once per process and family/size, saved under a private temporary dir
    that is removed when the process exits."""
    texts = tokenizer_corpus(target_chars=150_000, seed=0)
    root = tempfile.mkdtemp(prefix=f"asyncrl-{family}-tok-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    out = Path(root) / "tokenizer"
    save_tokenizer(build_bpe_tokenizer(family, texts, vocab_size), out)
    return out


def small_tokenizer(family: Family, vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A quick ``family``-style tokenizer for tests (Qwen: no BOS, im_start/im_end turns;
    Llama-3: BOS, header turns), trained on one corpus round (~330 kB) and loaded back
    through ``asyncrl.models.load_tokenizer``. Training runs once per process; each call
    returns a fresh object, so a test may change it freely."""
    return load_tokenizer(_small_tokenizer_dir(family, vocab_size))
