"""Episodes as token ids (``asyncrl.episodes``): observations rendered onto token ids equal
the chat template's rendering of the whole conversation, replay from a recorded prefix
rebuilds the same episode, bounds end episodes with "length", and tool or environment
failures become observations and counts, never exceptions."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from asyncrl.chat_tokenizers import small_tokenizer
from asyncrl.episodes import Environment, Step
from asyncrl.episodes.env import check_environment
from asyncrl.episodes.episode import Episode, EpisodeRules
from asyncrl.tasks import Example, TaskConfig
from asyncrl.tasks.prompts import PromptRenderer


class Script(Environment):
    """Answers turn k with ``answers[k]``; the turn after the last answer ends it."""

    answers = ["first answer", "second answer"]

    def __init__(self, example: Example) -> None:
        super().__init__(example)
        self.k = 0

    def step(self, turn: str) -> Step:
        if self.k == len(self.answers):
            return Step(reward=1.0, done=True)
        self.k += 1
        return Step(observation=self.answers[self.k - 1])


class Tools(Environment):
    def step(self, turn: str) -> Step:
        if turn == "slow":
            return Step(observation=self.tool(time.sleep, 1.0, timeout_s=0.05))
        if turn == "broken":
            return Step(observation=self.tool(int, "x"))
        raise RuntimeError("an environment bug")


EXAMPLE = Example(uid="train:0", prompt="What is 2+3?", answer="5")


def _rules(tokenizer, chat: bool, **kw) -> EpisodeRules:
    renderer = PromptRenderer(tokenizer, "chat" if chat else "plain")
    return EpisodeRules(renderer, **{"max_turns": 4, "max_tokens": 400, "turn_tokens": 50, **kw})


def _turn(tokenizer, text: str, end: bool = True) -> list[int]:
    """A model turn as an engine would sample it: its text, then the end of turn."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids + [tokenizer.eos_token_id] * end


def _add(episode: Episode, ids: list[int], logprob: float, version: int) -> None:
    episode.add_turn(ids, [logprob] * len(ids), [version] * len(ids))


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_observations_render_as_the_chat_template_renders_the_conversation(family):
    tokenizer = small_tokenizer(family)
    rules = _rules(tokenizer, chat=True)
    prompt = rules.renderer.prompt_ids(EXAMPLE)
    episode = Episode(Script(EXAMPLE), prompt, rules)
    turns = ["Let me add.", "It is 5."]
    for text in turns:
        _add(episode, _turn(tokenizer, text), 0.0, 0)
        episode.respond()
    conversation = [{"role": "user", "content": EXAMPLE.prompt}]
    for text, answer in zip(turns, Script.answers):
        conversation += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": answer},
        ]
    expected = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert episode.context() == list(expected)
    # Model turns are trained, observations are not, and neither was re-tokenized.
    assert [t for t, m in zip(episode.token_ids, episode.loss_mask) if m] == sum(
        (_turn(tokenizer, t) for t in turns), []
    )


def test_plain_observations_are_their_text_and_the_episode_ends_with_the_environment():
    tokenizer = small_tokenizer("qwen")
    rules = _rules(tokenizer, chat=False)
    episode = Episode(Script(EXAMPLE), [1, 2], rules)
    for k in range(3):
        _add(episode, _turn(tokenizer, f"turn {k}", end=False), -0.5, k)
        episode.respond()
    assert (episode.finish_reason, episode.reward, episode.turns) == ("stop", 1.0, 3)
    text = tokenizer.decode(episode.token_ids)
    assert text == "turn 0first answerturn 1second answerturn 2"
    model = [v for v, m in zip(episode.versions, episode.loss_mask) if m]
    assert -1 not in model and set(
        v for v, m in zip(episode.versions, episode.loss_mask) if not m
    ) == {-1}


def test_replay_rebuilds_the_episode_and_answers_an_unanswered_last_turn():
    tokenizer = small_tokenizer("qwen")
    rules = _rules(tokenizer, chat=True)
    prompt = rules.renderer.prompt_ids(EXAMPLE)
    original = Episode(Script(EXAMPLE), prompt, rules)
    _add(original, _turn(tokenizer, "one"), -1.0, 3)
    original.respond()
    _add(original, _turn(tokenizer, "two"), -2.0, 4)
    answered = len(original.token_ids)
    original.respond()
    # The recorded prefix stops after the second turn: its answer never reached the buffer.
    rebuilt = Episode(Script(EXAMPLE), prompt, rules)
    args = [
        getattr(original, name)[:answered]
        for name in ("token_ids", "logprobs", "versions", "loss_mask")
    ]
    assert rebuilt.replay(*args) is True
    rebuilt.respond()
    assert rebuilt.token_ids == original.token_ids and rebuilt.loss_mask == original.loss_mask
    assert (rebuilt.turns, rebuilt.replay_mismatches) == (2, 0)

    class Forgetful(Script):  # not replayable: answers differently the second time
        answers = ["other answer", "second answer"]

    again = Episode(Forgetful(EXAMPLE), prompt, rules)
    whole = [getattr(original, n) for n in ("token_ids", "logprobs", "versions", "loss_mask")]
    assert again.replay(*whole) is False and again.replay_mismatches == 1
    assert again.token_ids == original.token_ids  # the recorded observations stand


def test_bounds_end_an_episode_with_length():
    tokenizer = small_tokenizer("qwen")
    turns = Episode(Script(EXAMPLE), [1], _rules(tokenizer, chat=False, max_turns=1))
    _add(turns, [5, 6], 0.0, 0)
    turns.respond()
    assert turns.finish_reason == "length" and turns.reward == 0.0
    tokens = Episode(Script(EXAMPLE), [1], _rules(tokenizer, chat=False, max_tokens=4))
    _add(tokens, [5, 6], 0.0, 0)
    tokens.respond()
    assert len(tokens.token_ids) == 4 and tokens.finish_reason == "length"
    assert tokens.budget() == 0
    turn = Episode(Script(EXAMPLE), [1], _rules(tokenizer, chat=False, max_tokens=10))
    assert turn.budget() == 10 and _rules(tokenizer, False, turn_tokens=3).turn_tokens == 3


def test_tool_failures_and_environment_bugs_become_observations_and_counts():
    tokenizer = small_tokenizer("qwen")
    rules = _rules(tokenizer, chat=False)
    episode = Episode(Tools(EXAMPLE), [1], rules)
    for turn in ("slow", "broken"):
        _add(episode, _turn(tokenizer, turn, end=False), 0.0, 0)
        start, end = episode.respond()
        assert tokenizer.decode(episode.token_ids[start:end]).startswith("error: ")
    assert (episode.env.tool_calls, episode.env.tool_errors) == (2, 2)
    _add(episode, _turn(tokenizer, "crash", end=False), 0.0, 0)
    episode.respond()
    assert (episode.finish_reason, episode.reward, episode.env.tool_errors) == ("stop", 0.0, 3)


def test_a_multi_turn_config_that_cannot_run_fails_before_it_starts():
    check_environment(TaskConfig(environment="tests.test_episodes:Script"))
    bad = [
        (TaskConfig(environment="tests.test_episodes:Nope"), "cannot be imported"),
        (TaskConfig(environment="tests.test_episodes"), "module:Class"),
        (TaskConfig(environment="tests.test_episodes:EXAMPLE"), "not an asyncrl Environment"),
        (TaskConfig(environment="tests.test_episodes:Script", max_turns=0), "at least 1"),
        (
            TaskConfig(environment="tests.test_episodes:Script", rewards={"format": 1.0}),
            "its environment's",
        ),
    ]
    for cfg, message in bad:
        with pytest.raises(ValueError, match=message):
            check_environment(cfg)


def test_the_readmes_custom_environment_runs_as_shown():
    """The README's example environment, executed as printed, under 40 lines."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Agents and tools") :]
    code = section[section.index("```python\n") + 10 : section.index("```\n", 10)]
    assert len(code.splitlines()) < 40
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    env = namespace["Calculator"](Example(uid="eval:0", prompt="123*45\n", answer="5535"))
    assert env.step("calc 123*45") == Step(observation="= 5535\n")
    assert env.step("calc 123+45").observation.startswith("= error: ")
    assert env.step("answer 5535") == Step(reward=1.0, done=True)
    assert env.step("what?") == Step(reward=0.0, done=True)
    assert (env.tool_calls, env.tool_errors) == (2, 1)
