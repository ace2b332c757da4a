"""Word-level tokenizer for the testbed, built offline from the corpus vocabulary.

Why word-level: it is deterministic by construction (no trainer, the vocabulary is the corpus's
fixed word list), one word is one token so sequences stay short, and token ids are readable in
test failures. Unknown words map to ``<unk>``. It is a real ``PreTrainedTokenizerFast`` with a BOS
post-processor and a chat template, so SGLang and transformers load it like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hs_tracer_testbed.corpus import all_words

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens, then every corpus word in corpus order."""
    tokens = [*SPECIAL_TOKENS, *all_words()]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The testbed tokenizer (in memory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder joins tokens with single spaces (and handles no "##" here).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Write the tokenizer files into ``out_dir`` (tokenizer.json, tokenizer_config.json, ...)."""
    fast = build_tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast
