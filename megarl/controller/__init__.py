"""The controller: a run (`megarl train`) and its step.

`run.train(recipe)` starts a run (data, weights, roles, resume) and hands it to
`loop.StepLoop`, whose steps are `step.Trainer.step`: one PPO/GRPO step, the phase
table of docs/step.md. Around them: checkpoints, resume, preemption, validation, the
reward loop and the optional SFT warm-up. Ray lives in `megarl.cluster`, metric sinks
in `megarl.tracking`, the other commands in `megarl.commands`. Nothing is imported
here so that `import megarl.controller` stays cheap.
"""
