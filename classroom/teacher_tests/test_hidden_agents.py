"""Hidden tests of agents.py's exercise: an episode's masks from its segments, with empty segments anywhere in a
row, the environment first, one segment alone and more padding than any row needs. Each is a property (every
segment's positions carry its kind, the token mask is the row's prefix, empty segments change nothing) or a
hand-computed mask, never the formula again."""
import torch

import agents
from teacher_tests.batches import generator


def test_episode_masks_hand_computed_with_empty_segments_one_segment_and_the_environment_first():
    lengths = torch.tensor([[2, 0, 1, 0, 3], [0, 3, 0, 0, 0], [2, 2, 0, 0, 0]])
    is_action = torch.tensor([[True, False, False, True, True], [False, False, True, True, True],
                              [False, True, True, True, True]])
    mask, token_mask = agents.episode_masks(lengths, is_action, 9)
    assert mask.dtype == token_mask.dtype == torch.long and mask.shape == token_mask.shape == (3, 9)
    assert mask.tolist() == [[1, 1, 0, 1, 1, 1, 0, 0, 0],   # an empty segment of each kind between the others
                             [0, 0, 0, 0, 0, 0, 0, 0, 0],   # the environment's one segment, empty actions after it
                             [0, 0, 1, 1, 0, 0, 0, 0, 0]]   # the environment first
    assert token_mask.tolist() == [[1] * 6 + [0] * 3, [1] * 3 + [0] * 6, [1] * 4 + [0] * 5]


def test_episode_masks_of_random_segments_give_each_segment_its_kind_and_nothing_to_the_padding():
    g = generator(61)
    lengths = torch.randint(0, 5, (8, 6), generator=g) * (torch.rand(8, 6, generator=g) < 0.7)
    is_action = torch.rand(8, 6, generator=g) < 0.5
    width = int(lengths.sum(1).max()) + 3
    mask, token_mask = agents.episode_masks(lengths, is_action, width)
    assert mask.dtype == token_mask.dtype == torch.long and mask.shape == (8, width)
    for b in range(8):
        start = 0
        for length, action in zip(lengths[b].tolist(), is_action[b].tolist()):
            assert mask[b, start:start + length].tolist() == [int(action)] * length, (b, start)
            start += length
        assert token_mask[b].tolist() == [1] * start + [0] * (width - start), b
        assert mask[b, start:].sum() == 0, b
        alone = agents.episode_masks(lengths[b:b + 1], is_action[b:b + 1], width)  # a row is its own
        assert alone[0][0].tolist() == mask[b].tolist() and alone[1][0].tolist() == token_mask[b].tolist()
        kept = lengths[b] > 0  # without its empty segments, the same row
        none_empty = agents.episode_masks(lengths[b:b + 1, kept], is_action[b:b + 1, kept], width)
        assert none_empty[0][0].tolist() == mask[b].tolist(), b
