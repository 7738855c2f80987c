"""The n-gram (prompt lookup) proposer against hand-worked token lists."""

from llmpipe.spec.ngram import ngram_continuation


def test_longest_suffix_match_proposes_what_followed_it():
    tokens = [5, 1, 2, 3, 9, 9, 4, 1, 2, 3, 7, 8, 6, 2, 3]
    # "2 3" last occurred at 8-9 (followed by 7 8 6); the 3-gram "6 2 3" never occurred before.
    assert ngram_continuation(tokens, 3, 1, 3) == [7, 8, 6]
    assert ngram_continuation([1, 2, 3, 9, 1, 2, 3], 2, 2, 4) == [9, 1]  # the 3-gram "1 2 3" wins


def test_latest_match_wins_and_k_caps_the_length():
    assert ngram_continuation([4, 1, 5, 1, 6, 7, 1], 1, 1, 1) == [6]
    assert ngram_continuation([4, 1, 5, 1, 6, 7, 1], 5, 1, 1) == [6, 7, 1]  # stops at the end


def test_no_proposal_below_min_n_or_without_a_match():
    assert ngram_continuation([1, 2, 3, 4, 5, 3], 4, 2, 3) == []  # only a 1-gram matches
    assert ngram_continuation([1, 2, 3, 4, 5, 3], 4, 1, 3) == [4, 5, 3]
    assert ngram_continuation([7], 4, 1, 3) == []
    assert ngram_continuation([1, 2, 1, 2], 0, 1, 3) == []
