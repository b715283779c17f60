"""Plain Flower FedAvg on the digits CNN: the deployment benchmark's anchor."""
