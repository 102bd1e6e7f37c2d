"""Privacy attacks (issue #36): what a curious or malicious server recovers from clients' uploads
(gradient inversion) and from the global model (membership inference). Importing this package
registers them; heavy libraries (torchmetrics, scipy, matplotlib) are imported only where they run,
so a device's ClientApp, which loads every registry, never needs them."""

from fedsim.leakage import membership  # noqa: F401  loss_threshold, lira_offline
from fedsim.leakage import imprint  # noqa: F401  Robbing the Fed (the malicious `imprint` model)
from fedsim.leakage import dlg, inverting  # noqa: F401  dlg, idlg, inverting_gradients
