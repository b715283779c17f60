"""Client side: the ClientApp (``client.app``) and its pure math (``client.update``,
``client.sampling``), which import no flwr."""
