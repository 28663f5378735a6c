# CPU (2-core EPYC, no GPU), 2026-12-07, thirty-eighth session, code of 356100d: preset=qwen_coder's 0.5B sibling
# (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF dequantized) distilled from the real Qwen2.5-Coder-1.5B-Instruct at three
# settings, each 40 steps of 4 rows on the same teacher data (51 training and 13 held-out code prompts, 48-token greedy
# answers), from a fresh directory: the held-out TVD at steps 0, 20 and 40 of each (stage.json's history).
cd /tmp/lrx
common=(preset=qwen_coder draft=sibling device=cpu distill.compile=false distill.max_steps=40 distill.eval_every=20
  distill.warmup_steps=5 distill.batch_size=4 distill.max_seq_len=256 distill.teacher.max_new_tokens=48
  distill.teacher.batch_size=16 distill.teacher.extra_samples=0 distill.target_states_gib=4 data.max_prompts=64
  stop_after=distill tracking.enabled=false paths.root=/tmp/lrx/runs)
draftsmith run -m "${common[@]}" distill.learning_rate=5e-4,3e-5  # every weight: the gpu preset's rate, and 1/16 of it
draftsmith run "${common[@]}" distill.learning_rate=5e-4 draft.lora_rank=16  # rank-16 adapters at the gpu preset's rate
