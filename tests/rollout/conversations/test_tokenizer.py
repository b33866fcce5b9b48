"""The built-in tokenizer behaves like a checkpoint's: round trips, chat template, save and reload."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from treerl.errors import ModelPathError
from treerl.rollout.conversations.tokenizer import CHARACTERS, PLAIN_CHAT_TEMPLATE, builtin_tokenizer, load_tokenizer


def test_every_character_is_one_token_and_round_trips(tokenizer):
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    ids = tokenizer(CHARACTERS, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(CHARACTERS)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == CHARACTERS


def test_chat_template_marks_roles_and_ends_turns_with_eos(tokenizer):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "3+4="}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<bos>", "<system>", "s", "<eos>", "<user>", "3", "+", "4", "=", "<eos>", "<assistant>"
    ]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "s3+4="


def test_save_and_reload_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    text = "guess 1-9\n<user>x"
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert again.chat_template == tokenizer.chat_template
    assert again.eos_token_id == tokenizer.eos_token_id and len(again) == len(tokenizer)


def test_checkpoint_without_chat_template_gets_the_plain_format(tmp_path):
    base = builtin_tokenizer()
    base.chat_template = None
    base.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.chat_template == PLAIN_CHAT_TEMPLATE
    text = loaded.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "User: hi\nAssistant: "


@pytest.mark.slow
def test_a_base_model_whose_tokenizer_starts_text_with_bos_gets_it_in_the_plain_format():
    """Gemma 3 270M base (its tokenizer has no chat template and puts <bos> first): the plain format's prompt starts
    with <bos>, as the model's pretraining text did, and the reply's tokens follow as the tokenizer writes them."""
    from real_gemma import gemma_dir

    gemma = load_tokenizer(gemma_dir())
    ids = gemma.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True,
                                    return_dict=False)
    assert ids == gemma("User: 3+4=\nAssistant: ").input_ids and ids[0] == gemma.bos_token_id
    assert ids.count(gemma.bos_token_id) == 1


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelPathError, match="never downloads"):
        load_tokenizer(tmp_path / "nope")
