"""ModelOpt's NVFP4 peer moved to solrl_engine.nn.modelopt_peer, beside the QuantLinear it fills (quant/ imports
nothing else of the engine)."""

raise ImportError("solrl_engine.quant.modelopt_peer moved: import solrl_engine.nn.modelopt_peer")
