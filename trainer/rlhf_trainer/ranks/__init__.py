"""The ZeRO ranks as Ray actors (policy, reference, critic), their worker groups, and adopting them
from a killed driver."""
