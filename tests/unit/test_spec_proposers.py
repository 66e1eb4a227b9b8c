"""Draft proposers from token ids alone (engine/spec/ngram.py, suffix.py): what they propose,
and that nothing else is needed to propose for a request never seen before."""

from __future__ import annotations

from builders import make_request

from cluster.config import SpeculativeConfig
from cluster.engine.spec.ngram import NgramProposer, ngram_draft
from cluster.engine.spec.suffix import SuffixProposer, likeliest_path


def test_ngram_takes_the_longest_recurring_suffix_and_its_latest_occurrence():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 6, 7]
    # suffix [6, 7] occurs at 1 and at 6: the latest (6) proposes what followed it: 3, 4, 8
    assert ngram_draft(tokens, 3, 1, 4) == [3, 4, 8]
    # a longer recurring suffix wins over a more recent shorter one
    tokens = [1, 2, 9, 6, 7, 40, 41, 3, 6, 7, 50, 2, 9, 6, 7]
    assert ngram_draft(tokens, 2, 1, 4) == [40, 41]  # [2, 9, 6, 7] at 1, not [6, 7] at 8
    assert ngram_draft(tokens, 2, 1, 1) == [50, 2]  # max 1: the latest [7] is at 9
    assert ngram_draft([1, 2, 3, 4], 3, 1, 3) == []  # nothing recurs
    assert ngram_draft([1, 2, 3, 1, 2], 3, 3, 3) == []  # min 3: [1, 2] is too short


def test_ngram_matches_whole_tokens_only():
    # int32 little-endian: 256 = 00 01 00 00, 0 = 00 00 00 00, 1 = 01 00 00 00. The bytes of [1]
    # occur one byte into [256, 0]; a byte-level match there is not a token match.
    assert ngram_draft([256, 0, 7, 1], 2, 1, 2) == []
    assert ngram_draft([256, 1, 7, 1], 2, 1, 2) == [7, 1]


def test_ngram_proposer_respects_each_request_s_limit():
    prop = NgramProposer(SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3))
    a = make_request(prompt=[1, 2, 3, 4, 5, 1, 2])
    b = make_request(prompt=[9, 8, 7, 9, 8])
    assert prop.propose([a, b], [2, 0]) == [[3, 4], []]


def test_suffix_path_follows_the_most_frequent_continuation_while_it_is_likely():
    continuations = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [1, 5]]
    assert likeliest_path(continuations, 3) == [1, 2, 3]  # 4/4, then 3/4, then 2/3: p = 0.5
    assert likeliest_path([[1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11]], 3) == []  # 1/11 < 0.1
    assert likeliest_path(continuations, 1) == [1]


def test_suffix_drafts_from_the_outputs_of_earlier_requests():
    prop = SuffixProposer(SpeculativeConfig(method="suffix"))
    earlier = make_request(prompt=[100, 101])
    earlier.token_ids += [7, 8, 9, 10, 11, 12, 13]  # its output: a tool call, say
    prop.finish(earlier)
    fresh = make_request(prompt=[300, 301, 7, 8, 9])  # never seen before; its own tokens don't recur
    assert prop.propose([fresh], [3]) == [[10, 11, 12]]
    # its own sequence counts too: a pattern it repeats
    own = make_request(prompt=[40, 41, 42, 43, 44, 45, 40, 41, 42])
    assert prop.propose([own], [2]) == [[43, 44]]


def test_suffix_global_corpus_is_bounded_oldest_out_first():
    prop = SuffixProposer(SpeculativeConfig(method="suffix"), global_tokens=12)
    for first in (10, 20, 30):
        r = make_request(prompt=[1])
        r.token_ids += [first, first + 1, first + 2, first + 3, first + 4]
        prop.finish(r)
    # 3 outputs of 5 tokens + separators = 18 > 12: the first one is gone
    assert prop.propose([make_request(prompt=[99, 10, 11])], [2]) == [[]]
    assert prop.propose([make_request(prompt=[99, 30, 31])], [2]) == [[32, 33]]
