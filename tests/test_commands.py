import json

from pd_deploy.commands import PrefillSpec, vllm_prefill_argv


def test_prefill_argv_carries_one_speculative_config_with_the_draft_count():
    argv = vllm_prefill_argv(PrefillSpec(model="/m/glm", port=8100, num_speculative_tokens=3))
    assert argv.count("--speculative-config") == 1
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert "--speculative-config" not in vllm_prefill_argv(PrefillSpec(model="/m/glm", port=8100, mtp=False))


def test_the_mtp_drafter_gets_the_targets_attention_backend():
    # vLLM picks the drafter's backend itself (AMX_MLA on an AMX CPU, beside a CPU_MLA target)
    for extra in (("--attention-backend", "CPU_MLA"), ("--attention-backend=CPU_MLA",)):
        argv = vllm_prefill_argv(PrefillSpec(model="/m/tiny", port=8100, extra_args=extra))
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        assert spec == {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "CPU_MLA"}


def test_glm51_prefill_carries_the_cache_flags_its_profile_needs():
    argv = vllm_prefill_argv(PrefillSpec(model="/m/glm", port=8100, profile="glm5.1"))
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_ds_mla"
    assert argv[argv.index("--block-size") + 1] == "64"
    for profile in ("auto", "tiny"):  # vLLM's default cache is the CPU MLA layout
        argv = vllm_prefill_argv(PrefillSpec(model="/m/tiny", port=8100, profile=profile))
        assert "--kv-cache-dtype" not in argv and "--block-size" not in argv
    # a flag the operator passes wins (once on the command line), the others stay
    argv = vllm_prefill_argv(PrefillSpec(model="/m/glm", port=8100, profile="glm5.1",
                                         extra_args=("--block-size=128",)))
    assert "--block-size" not in argv and argv.count("--block-size=128") == 1
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_ds_mla"
