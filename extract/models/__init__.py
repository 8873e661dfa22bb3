"""Frozen backbones and what feeds them: open_clip models with patch / token outputs (backbone), where weights come from
(weights), tokenisation with character spans (tokens), Long-CLIP context (long_context); the tiny configs and the
shipped toy bases are data here (model_configs/, bases/, backbones.json)."""
