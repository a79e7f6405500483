// dramatiq-guard dashboard: keep the live part of the page up to date while it is open.
// The server renders (and escapes) the fragment; this only swaps it in.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live || !live.dataset.live) {
    return;
  }
  var every = parseInt(live.dataset.every, 10) || 1500;
  function tick() {
    fetch(live.dataset.live, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) {
          throw new Error(response.status);
        }
        return response.text();
      })
      .then(function (html) {
        live.innerHTML = html;
        document.body.classList.remove("stale");
      })
      .catch(function () {
        document.body.classList.add("stale");
      })
      .then(function () {
        window.setTimeout(tick, every);
      });
  }
  window.setTimeout(tick, every);
})();
