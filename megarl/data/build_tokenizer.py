"""Build the in-repo tokenizer (`megarl/assets/tokenizer/`) from a generated corpus.

`python -m megarl.data.build_tokenizer OUT_DIR` writes tokenizer.json,
tokenizer_config.json and special_tokens_map.json. The tokenizer is byte-level
BPE (any text encodes) with every digit its own token, a ChatML chat template
and exactly `VOCAB_SIZE` entries; training is deterministic, so rebuilding gives
the committed tokenizer.json byte for byte.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512
ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD]
CORPUS_SEED = 0

# ChatML, as Qwen uses it, without a default system prompt: the prompt for a
# user turn ends with "<|im_start|>assistant\n" and the model answers until <|im_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina", "Randy", "Joy"]
_ITEMS = ["apples", "clips", "books", "cookies", "marbles", "pencils", "eggs", "tickets", "shirts", "flowers"]
_PLACES = ["store", "market", "school", "bakery", "farm", "library"]
_MATH_PROBLEMS = [
    "Find the value of $x$ such that $x^2 - {a}x + {b} = 0$.",
    "Compute $\\dfrac{{{a}}}{{{b}}} + \\frac{{1}}{{{c}}}$.",
    "What is the area of a circle with radius ${a}$? Express your answer in terms of $\\pi$.",
    "Simplify $\\sqrt{{{a}}} \\cdot \\sqrt{{{b}}}$.",
    "If $f(x) = {a}x + {b}$, what is $f({c})$?",
    "Evaluate $\\left( {a} + {b} \\right)^2 - {c}$.",
    "How many positive divisors does ${a}$ have?",
    "Let $\\theta$ be an angle with $\\sin \\theta = \\frac{{{a}}}{{{b}}}$. Find $\\cos 2\\theta$.",
]
_MATH_STEPS = [
    "We have $x = \\frac{{{a} \\pm \\sqrt{{{b}}}}}{{2}}$, so the answer is $\\boxed{{{c}}}$.",
    "Multiplying both sides by ${a}$ gives ${b}x = {c}$, hence $x = \\boxed{{\\frac{{{c}}}{{{b}}}}}$.",
    "The area is $\\pi r^2 = {a}\\pi$, so the answer is $\\boxed{{{a}\\pi}}$.",
    "\\begin{{align*}}\nf({c}) &= {a} \\cdot {c} + {b} \\\\\n&= \\boxed{{{b}}}.\n\\end{{align*}}",
    "Since ${a} = 2^{{{b}}} \\cdot 3$, there are $\\boxed{{{c}}}$ divisors.",
    "Therefore the answer is $\\boxed{{{a}^\\circ}}$ or $\\boxed{{{b}\\%}}$ of the total.",
]


def _arithmetic_lines(rng: random.Random) -> Iterator[str]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    yield f'What is {a} + {b}? Answer after "####".'
    yield f"#### {a + b}"


def _gsm8k_lines(rng: random.Random) -> Iterator[str]:
    name, item, place = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_PLACES)
    have, more, price = rng.randint(2, 90), rng.randint(2, 40), rng.randint(1, 20)
    total = have + more
    yield (
        f"{name} has {have} {item}. {name} buys {more} more {item} at the {place} for ${price} each. "
        f"How many {item} does {name} have now, and how much money did {name} spend? "
        "Let's think step by step and output the final answer after \"####\"."
    )
    yield (
        f"{name} has {have} + {more} = <<{have}+{more}={total}>>{total} {item} in total.\n"
        f"The {item} cost {more} * {price} = <<{more}*{price}={more * price}>>{more * price} dollars.\n"
        f"#### {total}"
    )


def _math_lines(rng: random.Random) -> Iterator[str]:
    a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 99)
    yield rng.choice(_MATH_PROBLEMS).format(a=a, b=b, c=c) + (
        " Let's think step by step and output the final answer within \\boxed{}."
    )
    yield rng.choice(_MATH_STEPS).format(a=a, b=b, c=c)


def corpus(num_examples: int = 3000, seed: int = CORPUS_SEED) -> Iterator[str]:
    """The training text: interleaved arithmetic, GSM8K-like and MATH-like examples, plus chat role names."""
    rng = random.Random(seed)
    generators = (_arithmetic_lines, _gsm8k_lines, _math_lines)
    for index in range(num_examples):
        yield from generators[index % len(generators)](rng)
    yield from ["user", "assistant", "system"] * 500


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer; its vocabulary (special tokens included) is exactly VOCAB_SIZE."""
    tokenizer = Tokenizer(models.BPE())
    # Digits first, one per pre-token, so BPE can never merge them: "123" is
    # always "1" "2" "3", which keeps arithmetic learnable by tiny models.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab is {tokenizer.get_vocab_size()}, expected {VOCAB_SIZE}: corpus too small")
    return tokenizer


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(out_dir: Path) -> None:
    """Write the tokenizer files that `transformers.AutoTokenizer.from_pretrained(out_dir)` loads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    special_tokens = {"eos_token": IM_END, "pad_token": PAD, "additional_special_tokens": [IM_START, ENDOFTEXT]}
    _write_json(out_dir / "special_tokens_map.json", special_tokens)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_tokens,
            "bos_token": None,
            "unk_token": None,
            "model_max_length": 32768,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m megarl.data.build_tokenizer OUT_DIR", file=sys.stderr)
        return 2
    write_tokenizer(Path(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
