"""`check_prompt_token_ids`: plain ints take the fast path; every other element still gets the
per-element check and an error that names it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorrt_llm.inputs.validation import MAX_TOKEN_ID, check_prompt_token_ids


def test_plain_ints_come_back_as_a_new_list() -> None:
    ids = (5, 0, MAX_TOKEN_ID)
    out = check_prompt_token_ids(ids)
    assert out == [5, 0, MAX_TOKEN_ID] and type(out) is list
    source = [1, 2]
    assert check_prompt_token_ids(source) is not source
    assert check_prompt_token_ids([]) == []


def test_arrays_and_numpy_ints_are_accepted() -> None:
    assert check_prompt_token_ids(np.array([3, 4])) == [3, 4]
    assert check_prompt_token_ids(torch.tensor([7])) == [7]
    out = check_prompt_token_ids([np.int64(9), 2])
    assert out == [9, 2] and all(type(t) is int for t in out)


@pytest.mark.parametrize(
    "ids,error,where",
    [
        ([1, -1], ValueError, r"prompt_token_ids\[1\] must lie in"),
        ([MAX_TOKEN_ID + 1], ValueError, r"prompt_token_ids\[0\] must lie in"),
        ([2, True], TypeError, r"prompt_token_ids\[1\] must be an int, got bool"),
        ([1.0], TypeError, r"prompt_token_ids\[0\] must be an int, got float"),
        ([np.int32(-3)], ValueError, r"prompt_token_ids\[0\] must lie in"),
        ("12", TypeError, "must be a list of ints"),
    ],
)
def test_bad_elements_are_named(ids: object, error: type[Exception], where: str) -> None:
    with pytest.raises(error, match=where):
        check_prompt_token_ids(ids)
