"""A word-level tokenizer for the ledger task, built locally with `tokenizers` and wrapped as a
transformers fast tokenizer with a chat template (saved next to the teacher's weights)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from data_prep import ledger

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(ledger.VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins word-level tokens with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|sep|>"],
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
