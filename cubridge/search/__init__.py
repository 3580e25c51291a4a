"""The search: interfaces (api), CPU screening (screen), proposers, tile spaces (space), the
ask-and-tell tuner (tuner), job kinds (jobs), runners (local, ray, replay) and artifacts."""
