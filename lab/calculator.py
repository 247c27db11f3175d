"""The built-in environment, --environment calculator (lab/environments.py loads it): its calls are bounded and
run in the training process."""
import re


class Calculator:
    """--environment calculator: one tool that evaluates ONE binary integer operation, so a+b*c takes two calls.
    Its answers are short: a 1M-parameter character model reads them."""

    def reset(self, **kwargs):
        self.history = []  # (expression, result) of each call that succeeded
        return None

    def calculate(self, expression: str) -> str:
        """Evaluate one operation on two non-negative integers.

        Args:
            expression: Two integers and one operator between them: a+b, a-b or a*b (e.g. 34*5).
        """
        match = re.fullmatch(r"\s*(\d+)\s*([-+*])\s*(\d+)\s*", expression)
        if match is None:
            raise ValueError("need a+b, a-b or a*b")
        a, op, b = match.groups()
        if max(len(a), len(b)) > 9:
            raise ValueError("number too long")
        a, b = int(a), int(b)
        result = str(a + b if op == "+" else a - b if op == "-" else a * b)
        self.history.append((expression, result))
        return result
