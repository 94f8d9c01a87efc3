"""``AgentEnvironment`` (``asyncrl.episodes.openai_agent``): an agent using the real
``openai`` client, driven by scripted model turns through ``step`` as the generator drives
an episode. Observations are the messages the agent adds after each reply, its return is
the reward, and every way it can leave the episode (a history that differs, a raise, a
silence, a request the capture server refuses) ends it with reward 0, counted. Last, one
episode through ``Episode``, as the generator runs it, on a chat template's tokens."""

from __future__ import annotations

import contextlib
import re
import threading

import openai
import pytest

from asyncrl.chat_tokenizers import small_tokenizer
from asyncrl.episodes.env import Step
from asyncrl.episodes.episode import Episode, EpisodeRules
from asyncrl.episodes.openai_agent import AgentEnvironment
from asyncrl.tasks.base import Example
from asyncrl.tasks.prompts import PromptRenderer

EXAMPLE = Example(uid="train:0", prompt="What is 12 times 34?", answer="408")


class Multiply(AgentEnvironment):
    """Asks the model, runs "calc A*B" in its reply as a tool, answers the result as a
    user message; 1.0 when the reply without a calc holds the answer."""

    reply_timeout_s = 10.0

    def agent(self, client: openai.OpenAI) -> float:
        messages = [
            {"role": "system", "content": "Write calc A*B to multiply."},
            {"role": "user", "content": self.example.prompt},
        ]
        for _ in range(3):
            out = client.chat.completions.create(model=self.model, messages=messages)
            reply = self.seen(out)
            messages.append({"role": "assistant", "content": reply})
            calc = re.search(r"calc (\d+)\*(\d+)", reply)
            if calc is None:
                return float(self.example.answer in reply)
            messages.append({"role": "user", "content": f"result: {int(calc[1]) * int(calc[2])}"})
        return 0.0

    def seen(self, out) -> str:
        return out.choices[0].message.content


def run(env: AgentEnvironment, turns: list[str]) -> list[Step]:
    try:
        return [env.step(turn) for turn in turns]
    finally:
        env.close()
        assert not env._thread.is_alive()


def test_calls_become_turns_and_the_return_the_reward():
    env = Multiply(EXAMPLE)
    steps = run(env, ["Let me compute: calc 12*34", "It is 408."])
    assert steps[0] == Step(observation=[{"role": "user", "content": "result: 408"}])
    assert steps[1] == Step(reward=1.0, done=True)
    assert (env.tool_calls, env.tool_errors, env.mismatches) == (2, 0, 0)
    # A wrong final answer is reward 0; the same turns replay the same observations.
    again = run(Multiply(EXAMPLE), ["Let me compute: calc 12*34", "It is 407."])
    assert again[0] == steps[0] and again[1] == Step(reward=0.0, done=True)


def test_the_agent_gets_chat_completions_in_openai_shape():
    responses = []

    class Recording(Multiply):
        def seen(self, out):
            responses.append(out)
            return super().seen(out)

    run(Recording(EXAMPLE), ["calc 2*3", "408"])
    assert len(responses) == 2
    for out in responses:
        assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
        assert out.model == "policy" and out.choices[0].finish_reason == "stop"
        assert out.choices[0].message.role == "assistant"
    assert [out.choices[0].message.content for out in responses] == ["calc 2*3", "408"]


class EditsTheReply(Multiply):
    def seen(self, out) -> str:
        return super().seen(out).strip()


class WrongPrompt(Multiply):
    def agent(self, client: openai.OpenAI) -> float:
        messages = [{"role": "user", "content": "What is 1 times 1?"}]
        client.chat.completions.create(model=self.model, messages=messages)
        return 1.0


@pytest.mark.parametrize(
    "cls,turns",
    [(WrongPrompt, ["1"]), (EditsTheReply, ["calc 12*34  "])],
)
def test_calls_that_do_not_follow_the_episode_end_it(cls, turns):
    env = cls(EXAMPLE)
    steps = run(env, turns)
    assert steps[-1] == Step(reward=0.0, done=True) and env.mismatches == 1
    assert env.tool_errors == 0 and not any(s.done for s in steps[:-1])


class Raises(Multiply):
    def seen(self, out) -> str:
        raise RuntimeError("tool crashed")


class ReturnsNoNumber(Multiply):
    def agent(self, client: openai.OpenAI) -> float:
        super().agent(client)
        return "408"  # type: ignore[return-value]  # a str is not a reward


class Streams(Multiply):
    def agent(self, client: openai.OpenAI) -> float:
        with contextlib.suppress(openai.BadRequestError):
            client.chat.completions.create(model="m", messages=[], stream=True)
        messages = [{"role": "user", "content": self.example.prompt}]
        client.chat.completions.create(model="m", messages=messages, n=2)
        return 1.0


@pytest.mark.parametrize("cls", [Raises, ReturnsNoNumber, Streams])
def test_an_agent_that_fails_ends_the_episode_with_reward_0(cls):
    env = cls(EXAMPLE)
    steps = run(env, ["408"])
    assert steps == [Step(reward=0.0, done=True)] and env.tool_errors == 1
    assert env.mismatches == 0


def test_a_silent_agent_times_out_and_its_later_calls_are_refused():
    release, returned, refused = threading.Event(), threading.Event(), []

    class Stalls(Multiply):
        reply_timeout_s = 0.3

        def seen(self, out) -> str:
            release.wait(10)
            return super().seen(out)

        def agent(self, client: openai.OpenAI) -> float:
            try:
                return super().agent(client)
            except openai.BadRequestError as exc:
                refused.append(exc)
                raise
            finally:
                returned.set()

    env = Stalls(EXAMPLE)
    assert env.step("calc 12*34") == Step(reward=0.0, done=True) and env.tool_errors == 1
    assert env.step("408") == Step(reward=0.0, done=True)  # ended episodes stay ended
    release.set()
    assert returned.wait(10)
    run(env, [])
    assert len(refused) == 1 and "has ended" in refused[0].body["message"]


def test_episodes_run_side_by_side():
    """Each episode's calls reach its own adapter (routed by the base URL's path)."""
    envs = [
        Multiply(Example(uid=f"train:{i}", prompt=f"What is {i} times 3?", answer=str(3 * i)))
        for i in range(4)
    ]
    firsts = [env.step(f"calc {i}*3") for i, env in enumerate(envs)]
    assert [s.observation for s in firsts] == [
        [{"role": "user", "content": f"result: {3 * i}"}] for i in range(4)
    ]
    lasts = [
        run(env, [f"It is {3 * i}." if i % 2 else "No idea."])[0] for i, env in enumerate(envs)
    ]
    assert [s.reward for s in lasts] == [0.0, 1.0, 0.0, 1.0] and all(s.done for s in lasts)
    assert len({env.base_url for env in envs}) == 4


def test_an_episode_of_the_agent_is_its_conversation_in_the_chat_template():
    """Through ``Episode`` as the generator runs it: the prompt, the model's turns (with
    their end-of-turn token) and the agent's messages are the chat template's rendering
    of the conversation, and the agent's return is the episode's reward."""
    tokenizer = small_tokenizer("qwen")
    renderer = PromptRenderer(tokenizer, "chat")
    env = Multiply(EXAMPLE)
    rules = EpisodeRules(renderer, max_turns=4, max_tokens=400, turn_tokens=100)
    episode = Episode(env, renderer.prompt_ids(EXAMPLE), rules)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for text in ["calc 12*34", "It is 408."]:
        ids = tokenizer.encode(text, add_special_tokens=False) + [end]
        episode.add_turn(ids, [0.0] * len(ids), [0] * len(ids))
        episode.respond()
    env.close()
    assert episode.finish_reason == "stop" and episode.reward == 1.0
    conversation = [
        {"role": "user", "content": EXAMPLE.prompt},
        {"role": "assistant", "content": "calc 12*34"},
        {"role": "user", "content": "result: 408"},
        {"role": "assistant", "content": "It is 408."},
    ]
    text = tokenizer.decode(episode.context())
    assert text == tokenizer.apply_chat_template(conversation, tokenize=False).rstrip("\n")
