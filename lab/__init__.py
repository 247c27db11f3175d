"""The lab: the five loops of the lesson files (remax.py ... ppo.py) with everything that changes how rollouts are
produced or corrected, and their engine (engine.py, sampling.py, async_sampling.py, budget.py, tree.py). The loops
import the lessons' math; with no lab feature on each gives the same run as its lesson
(tests/test_lesson_equals_lab.py). Run one as `python lab/grpo.py --help`."""
