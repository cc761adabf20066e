"""zerosafe's application layer: the `zerosafe` command and the Prefect flows and tasks that
schedule the engine's stages. The engine (`zerosafe`) never imports this package or Prefect."""
