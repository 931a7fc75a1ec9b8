"""The ``vlm-pack`` command line: ``analyze | pack | demo`` (``main``), its argument parser (``parser``) and how
a command finds the model's processor and family (``model``)."""
