# CPU (2-core EPYC), 2026-12-05: preset=qwen_coder's EAGLE-3 head and from-target W4A16 draft of the real
# Qwen2.5-Coder-1.5B-Instruct, trained for 4 steps (the check is of loading and of acceptance agreeing, not of
# the drafts' quality), then vLLM 0.32's CPU build on each bundle.
cd /tmp/qsmoke && draftsmith run -m preset=qwen_coder draft=eagle3,from_target device=cpu distill.compile=false \
  distill.max_steps=4 distill.eval_every=4 distill.batch_size=8 distill.max_seq_len=256 distill.teacher.max_new_tokens=24 \
  distill.teacher.batch_size=8 distill.teacher.extra_samples=0 distill.target_states_gib=8 data.max_prompts=40 \
  evaluate.num_prompts=4 evaluate.batch_size=2 evaluate.max_new_tokens=24 evaluate.max_speculative_tokens=2 \
  evaluate.min_alpha=0 evaluate.max_tau_loss=1 evaluate.min_speedup=0 quantize.num_calibration_samples=8 \
  quantize.calibration_max_length=128 tracking.enabled=false paths.root=/tmp/qsmoke/runs
for b in /tmp/qsmoke/runs/publish/*/bundle; do make -s vllm-check BUNDLE=$b; done
