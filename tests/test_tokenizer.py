"""The builtin tokenizer: loads through AutoTokenizer, single-digit tokens, ChatML template, lossless
round trip, and a deterministic rebuild that reproduces the committed files."""

from __future__ import annotations

import pytest
import transformers
from transformers import AutoTokenizer

from megarl.data import build_tokenizer
from megarl.data.tokenizer import builtin_tokenizer_dir, load_tokenizer
from megarl.errors import InputError


def test_loads_as_fast_tokenizer_with_chatml_specials(tokenizer):
    # Plain AutoTokenizer on the asset directory (what a user's HF code does) gives the same tokenizer.
    direct = AutoTokenizer.from_pretrained(str(builtin_tokenizer_dir()), local_files_only=True)
    assert type(direct) is type(tokenizer) and direct.get_vocab() == tokenizer.get_vocab()
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|pad|>"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    for special in ("<|im_start|>", "<|im_end|>", "<|pad|>", "<|endoftext|>"):
        assert special in tokenizer.all_special_tokens
        assert len(tokenizer.encode(special, add_special_tokens=False)) == 1
    assert tokenizer.bos_token is None  # nothing is prepended to prompts
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", add_special_tokens=False)


def test_every_digit_is_its_own_token(tokenizer):
    digit_ids = [tokenizer.convert_tokens_to_ids(str(digit)) for digit in range(10)]
    assert len(set(digit_ids)) == 10
    assert tokenizer.encode("9876543210", add_special_tokens=False) == [digit_ids[int(d)] for d in "9876543210"]
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("x = 2024, y=-17.5", add_special_tokens=False))
    assert [token for token in tokens if any(char.isdigit() for char in token)] == ["2", "0", "2", "4", "1", "7", "5"]
    # No entry of the vocabulary merges a digit with anything else.
    for token in tokenizer.get_vocab():
        if any(char.isdigit() for char in token):
            assert len(token) == 1, token


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
    dialogue = messages + [{"role": "assistant", "content": "#### 5"}]
    with_answer = tokenizer.apply_chat_template(dialogue, tokenize=False)
    assert with_answer == without + "<|im_start|>assistant\n#### 5<|im_end|>\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tokenizer.eos_token_id) == 1


@pytest.mark.parametrize(
    "text",
    [
        "Natalia sold 48 clips in April, and half as many in May.\n#### 72",
        r"Let $x = \dfrac{1}{2}$; then $\boxed{\sqrt{2}}$ \left( a \right)",
        "Unicode: héllo wörld — 你好, emoji 🙂, tabs\tand  double  spaces .",
        "   leading and trailing spaces   ",
    ],
)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text


def test_rebuild_reproduces_the_committed_files(tmp_path):
    assert build_tokenizer.main([str(tmp_path)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (builtin_tokenizer_dir() / name).read_bytes(), name


def test_load_tokenizer_builtin_path_and_missing(tmp_path):
    builtin = load_tokenizer()
    assert builtin.encode("What is 1 + 2?") == load_tokenizer(str(builtin_tokenizer_dir())).encode("What is 1 + 2?")
    with pytest.raises(InputError, match=r"tokenizer '/no/such/tokenizer': no such directory"):
        load_tokenizer("/no/such/tokenizer")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError) as error:
        load_tokenizer(str(tmp_path / "empty"))
    assert error.value.problems[0].startswith(f"tokenizer '{tmp_path / 'empty'}': cannot load it")
    assert len(error.value.problems) == 1 and "\n" not in error.value.problems[0]
