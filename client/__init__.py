"""Client side: the ClientApp (``client.app``) and its pure math (``client.update``,
``tasks.sampling``), which import no flwr."""
