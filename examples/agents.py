"""Tools and an environment in TRL's conventions, for the embedded agent model and its task (docs/agents.md):

    python lab/grpo.py --environment calculator                                        # the built-in environment
    python lab/grpo.py --environment examples/agents.py:Calculator --model_name_or_path embedded_model/agent \\
        --dataset tool_arithmetic --reward_fn examples/agents.py:call_cost
    python lab/grpo.py --tools examples/agents.py:calculate --model_name_or_path embedded_model/agent \\
        --dataset tool_arithmetic

With an environment or tools the default --max_new_tokens is an episode's budget (40 tokens: the model's turns and
the environment's replies). The same file works with TRL: `GRPOTrainer(..., tools=[calculate])` or `GRPOTrainer(..., environment_factory=
Calculator, reward_funcs=[..., call_cost])`. A tool is a typed function with a docstring whose Args section
describes each parameter: its JSON schema (transformers.utils.get_json_schema) is what a chat template shows the
model. Whatever a tool raises becomes the text the model reads back (`error: ...`), not the end of the run.
"""
import re


def calculate(expression: str) -> str:
    """Evaluate one operation on two non-negative integers.

    Args:
        expression: Two integers and one operator between them: a+b, a-b or a*b (e.g. 34*5).
    """
    match = re.fullmatch(r"\s*(\d{1,9})\s*([-+*])\s*(\d{1,9})\s*", expression)
    if match is None:
        raise ValueError("need a+b, a-b or a*b")
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


class Calculator:
    """An environment: one instance per episode, `reset` at its start (with the dataset row's columns), every public
    method but reset a tool. It keeps the episode's calls, which a reward function reads (`call_cost`)."""

    def reset(self, **row):
        self.calls = []
        return None  # or a text the prompt ends with

    def calculate(self, expression: str) -> str:
        """Evaluate one operation on two non-negative integers.

        Args:
            expression: Two integers and one operator between them: a+b, a-b or a*b (e.g. 34*5).
        """
        self.calls.append(expression)
        return calculate(expression)


def call_cost(completions, environments, **kwargs):
    """A reward function that reads the episodes' environments: -0.05 per call beyond two."""
    return [-0.05 * max(0, len(env.calls) - 2) for env in environments]
