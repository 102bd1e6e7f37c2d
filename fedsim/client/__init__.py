"""The ClientApp: local training for honest clients and attackers, and the encoded upload."""
