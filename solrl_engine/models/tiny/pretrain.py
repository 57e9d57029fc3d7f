"""The tiny model's pre-training moved to solrl_engine.pretrain (it uses the evaluator, the rewards and the
checkpoints, all above models/)."""

raise ImportError("solrl_engine.models.tiny.pretrain moved: import solrl_engine.pretrain (`solrl pretrain-tiny` is "
                  "unchanged)")
