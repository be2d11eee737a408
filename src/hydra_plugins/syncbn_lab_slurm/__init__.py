"""This project's Hydra plugins (Hydra loads launchers only from hydra_plugins.*)."""
