"""Client side: the ClientApp (``client.app``), one client's part of an exchange without Flower
(``client.local_round``: the method's client side on the executor the engine uses) and a
SuperNode's own data (``client.local_data``)."""
