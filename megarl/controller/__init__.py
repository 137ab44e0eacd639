"""The controller: Ray placement and worker groups, the step loop, validation, tracking, `megarl train`.

`run.train(recipe)` builds a run; `trainer.Trainer.step` is one PPO/GRPO step
(the phase table of DESIGN.md §1). Nothing is imported here so that
`import megarl.controller` stays cheap.
"""
