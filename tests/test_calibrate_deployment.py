"""calibrate.deployment: the verify rows' draft tokens follow the serve scripts' speculative settings."""

import pytest

from dsv4_sm120.calibrate.deployment import DeploymentError, from_env


@pytest.mark.parametrize("env,want", [
    ({}, 4),                                                            # V4-Flash: MTP layer, EAGLE 3 steps + 1
    ({"MODEL_PATH": "deepseek-ai/DeepSeek-V4-Flash-0731"}, 6),          # DSpark block 5 + 1
    ({"MODEL_PATH": "deepseek-ai/DeepSeek-V4-Flash-0731", "SPEC_DSPARK_BLOCK_SIZE": "3"}, 4),
    ({"SPEC_NUM_STEPS": "2"}, 3),
    ({"SPEC_NUM_DRAFT_TOKENS": "7"}, 7),
    ({"MODEL_PATH": "/nonexistent/checkpoint"}, 4),                    # draft unknown here: SGLang's EAGLE default
])
def test_draft_tokens(env, want):
    d = from_env(env)
    assert d.draft_tokens == want and d.tp == 4 and d.heads == 16


@pytest.mark.parametrize("env", [{"SPEC_NUM_DRAFT_TOKENS": "x"}, {"CONTEXT_LEN": "12k"}, {"SPEC_NUM_DRAFT_TOKENS": "0"}])
def test_bad_values_are_one_line_errors(env):
    with pytest.raises(DeploymentError):
        from_env(env)
