"""Tokenizer for the default model: byte-level BPE trained on the training text, GLM special tokens.

Owns: training the BPE model with the ``tokenizers`` library on ``train.jsonl`` (never the held-out
part), appending the GLM special tokens at the end of the vocabulary as the released checkpoint does,
and writing ``tokenizer.json`` plus a ``tokenizer_config.json`` that carries the GLM chat template.

    python train/tokenizer.py --data .gpu/data --out .gpu/tokenizer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 4096

# The released GLM tokenizer's special tokens, in its order; they take the last ids of the vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
)

# GLM's chat format: [gMASK]<sop><|system|>\n...<|user|>\n...<|assistant|>\n... ; an assistant turn ends
# where the next <|user|> begins, which is why <|user|> is an end-of-sequence token.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|system|>\n{{ content }}"
    "{%- elif message['role'] == 'user' -%}<|user|>\n{{ content }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>\n{{ content }}"
    "{%- elif message['role'] == 'tool' -%}<|observation|>\n{{ content }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n{%- endif -%}"
)

EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")


def iter_training_text(data: Path, batch: int = 256):
    rows: list[str] = []
    with open(data / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            rows.append(json.loads(line)["text"])
            if len(rows) == batch:
                yield rows
                rows = []
    if rows:
        yield rows


def train_tokenizer(data: Path, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_training_text(data), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def save(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path(".gpu/data"))
    parser.add_argument("--out", type=Path, default=Path(".gpu/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--model-max-length", type=int, default=4096)
    args = parser.parse_args()
    tok = train_tokenizer(args.data, args.vocab_size)
    save(tok, args.out, args.model_max_length)
    sample = "In the beginning God created the heaven and the earth."
    print(json.dumps({"vocab_size": tok.get_vocab_size(), "special_ids": special_ids(tok)}, indent=2))
    print(sample, "->", tok.encode(sample).tokens)


if __name__ == "__main__":
    main()
