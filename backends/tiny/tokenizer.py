"""Tokenizers trained on the spot for tiny test models.

Contract: `build_tokenizer` trains a byte-level BPE on a short English text embedded below and
saves it into a folder as a `PreTrainedTokenizerFast` with `<|bos|>`, `<|eos|>` and `<|pad|>`
set and a chat template (system, user and assistant turns, each closed by the eos token, so a
chat model stops where its turn ends). No bos is added by `encode`; the chat template adds it.
Byte-level means any Unicode text round-trips exactly through encode and decode once in NFC
(composed) form, which is how nearly all text arrives: like Qwen's tokenizers, it
NFC-normalises its input first. `build_wordpiece_vocab` gives the WordPiece vocabulary of the
tiny BERT encoders. Both are deterministic (the same files every time), fast (well under a
second) and need no network.

The tokenizer has exactly `vocab_size` tokens. The text yields about 500; larger vocabularies
(benchmark models) also train on made-up words drawn from a seeded generator, so nearly every
id still decodes to visible text, and whatever is left is filled with reserved special tokens,
as real tokenizers do.
"""

from __future__ import annotations

import random
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# Each turn is `<|role|>` + newline + content + eos; the eos ends an assistant turn too, so
# generation stops where the turn ends. Tools are shown the Hermes / Qwen 2.5 way (what the
# hub's default `hermes` tool parser reads): with `tools`, a system turn comes first with the
# caller's leading system message, then each tool's JSON inside `<tools>` and how to call
# one. An assistant turn writes its calls as `<tool_call>{"name", "arguments"}</tool_call>`,
# one per line after its content; consecutive `tool` messages make one user turn of
# `<tool_response>` blocks. Without tools and tool turns a conversation renders as before.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}"
    "{% endif %}"
    "{{ '# Tools\\n\\nThese functions can be called to answer; each is described by a JSON "
    "schema inside <tools></tools>:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ (tool | tojson) + '\\n' }}{% endfor %}"
    "{{ '</tools>\\n\\nTo call functions, answer with one JSON object per call, each "
    'inside <tool_call></tool_call>:\\n<tool_call>\\n{"name": <function name>, '
    "\"arguments\": <arguments object>}\\n</tool_call>' + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set role = message['role'] %}"
    "{% if role == 'system' and tools and loop.first %}"
    "{% elif role == 'assistant' and message['tool_calls'] %}"
    "{{ '<|assistant|>\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% elif role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|user|>\\n' }}{% else %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ eos_token + '\\n' }}{% endif %}"
    "{% elif role in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + role + '|>\\n' + (message['content'] or '') + eos_token + '\\n' }}"
    "{% else %}"
    "{{ raise_exception('Unknown role: ' + role) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Training text: plain prose with common English words, digits and punctuation.
TRAINING_TEXT = """\
The harbour town woke slowly on winter mornings. Fishing boats rocked against the stone quay,
gulls argued over the last of the night's catch, and the baker on Mill Street opened his
shutters at half past six. By seven the smell of fresh bread reached the water, and the first
customers stood in line with their collars turned up against the wind.

Mara kept the lighthouse at the end of the northern pier. She had kept it for twenty-one years,
and in all that time the lamp had failed only twice: once in the great storm of the first
spring, when the power line came down, and once when a careless engineer forgot to order new
bulbs. Each evening she climbed the one hundred and twelve steps, checked the lens, wrote the
weather in her notebook and watched the ships pass on their way to the open sea.

A model server answers many requests at the same time. Some ask for a short answer, some for a
long story, and some only want the meaning of a sentence as a list of numbers. The server reads
each request, decides which model should answer it, and loads that model into memory if it is
not already there. When memory runs short, the model that has waited longest without work is
moved out to make room. Good servers measure everything: how long each request waited, how many
tokens were produced per second, and how much memory every model used.

In the garden behind the school, the children planted beans, carrots, onions and three rows of
sunflowers. They watered them every afternoon and counted the new leaves on Fridays. By the end
of June the sunflowers were taller than the teacher, and the beans had climbed over the fence
into the neighbour's yard. Nobody minded; the neighbour said she liked the flowers and would
happily share the harvest.

Questions are easier to answer when they are clear. What time does the train leave? Which
platform? How much is a return ticket for two adults and one child? The clerk at the window
answered each question patiently, printed the tickets, and wished the family a pleasant journey.
The train left at 10:45 from platform 3, and it arrived on time, which surprised everyone.
"""

_BYTE_ALPHABET_SIZE = 256
# Qwen2's pipeline (NFC, this split, byte-level without its own regex). transformers rebuilds
# the pipeline of any folder whose config says model_type "qwen2" this way whatever
# tokenizer.json holds, so every tiny model uses it and all load the same tokenizer.
_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# The English text alone fills a vocabulary of about this size.
_TEXT_VOCAB_SIZE = 512


def _training_lines(vocab_size: int) -> list[str]:
    """The English text, plus seeded made-up words when `vocab_size` needs more merges."""
    lines = TRAINING_TEXT.splitlines(keepends=True)
    extra_words = 4 * max(0, vocab_size - _TEXT_VOCAB_SIZE)
    rng = random.Random(0)  # random.Random's choice/randint sequences are stable across versions
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words = [
        "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))
        for _ in range(extra_words)
    ]
    lines.extend(" ".join(words[i : i + 16]) + "\n" for i in range(0, len(words), 16))
    return lines


def _train_bpe(vocab_size: int, lines: Iterable[str]) -> Tokenizer:
    """A byte-level BPE with the special tokens first, trained on `lines` up to `vocab_size`
    tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def _fill_reserved(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Add reserved special tokens until the vocabulary holds exactly `vocab_size` tokens."""
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        reserved = [
            AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(missing)
        ]
        tokenizer.add_special_tokens(reserved)


def build_tokenizer(
    out_dir: Path, *, vocab_size: int = 512, texts: Iterable[str] | None = None
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE, save it into `out_dir` and return it.

    It trains on the English text above (and made-up words), or on `texts` when given (the
    trained pair's Python source); the special tokens and chat template are the same either way.

    The saved folder loads with `AutoTokenizer.from_pretrained(out_dir)`; the tokenizer has
    exactly `vocab_size` tokens, with ids 0, 1 and 2 for bos, eos and pad.
    """
    minimum = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{minimum} tokens (256 bytes and {len(SPECIAL_TOKENS)} special tokens)"
        )
    lines = _training_lines(vocab_size) if texts is None else texts
    raw = _train_bpe(vocab_size, lines)
    _fill_reserved(raw, vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Written as null: byte-level BPE never needs an unknown token, and without it
        # transformers' Qwen2Tokenizer (used for model_type "qwen2") adds its own
        # "<|endoftext|>", one token more than the model's vocabulary.
        unk_token=None,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_wordpiece_vocab(*, vocab_size: int = 512) -> dict[str, int]:
    """A lower-cased WordPiece vocabulary for the tiny BERT encoders, built from the same text.

    BERT special tokens come first, then every character (alone and as a `##` continuation,
    so any word of known characters tokenizes), then the text's words, most frequent first;
    `[unusedN]` tokens fill what remains, as in BERT's own vocabulary. Built by counting rather
    than with `tokenizers`' WordPiece trainer, whose tie-breaking varies between processes.
    """
    words = re.findall(r"\w+|[^\w\s]", _strip_accents(TRAINING_TEXT.lower()))
    alphabet = sorted(
        set(string.ascii_lowercase + string.digits + string.punctuation).union(*words)
    )
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens += alphabet + [f"##{char}" for char in alphabet if char.isalnum()]
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size={vocab_size} is too small: the alphabet needs {len(tokens)}")
    known = set(tokens)
    counts = Counter(word for word in words if word not in known)
    for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(tokens) == vocab_size:
            break
        tokens.append(word)
    tokens += [f"[unused{i}]" for i in range(vocab_size - len(tokens))]
    return {token: index for index, token in enumerate(tokens)}


def _strip_accents(text: str) -> str:
    decomposed = unicodedata.normalize("NFD", text)
    return "".join(char for char in decomposed if unicodedata.category(char) != "Mn")
