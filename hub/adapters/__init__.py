"""LoRA adapters as registry models, on the hub's side.

An adapter version is registered against one base LLM version (`registry.adapters`); the
manager gives it its own entry that depends on its base's (`hub.manager`), and a request
for it is served by the base's engine through an `AdapterBackend` (`binding`), a view of
the base's backend that names the adapter on every generation. `checks` is the serving
side's refusal at registration (shapes, target modules, unsupported PEFT features).
"""
