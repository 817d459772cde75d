import json

from pd_router.stack.commands import PrefillSpec, vllm_prefill_argv


def test_prefill_argv_carries_one_speculative_config_with_the_draft_count():
    argv = vllm_prefill_argv(PrefillSpec(model="/m/glm", port=8100, num_speculative_tokens=3))
    assert argv.count("--speculative-config") == 1
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert "--speculative-config" not in vllm_prefill_argv(PrefillSpec(model="/m/glm", port=8100, mtp=False))
